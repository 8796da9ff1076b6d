"""Assemble and run one GPT pretraining job: the body of ``pretrain_gpt_domino.py``.

The order matters and follows Megatron-LM's ``pretrain``: flags are parsed and validated
first, against the world size the launcher announced, so that a bad flag fails before any
process group, file or directory exists. Then, inside the runtime the device needs (the CPU
runtime without a GPU), the process groups and RNG streams are set up, the model is built
(and Domino applied, if asked for), wrapped in Megatron-Core's DDP and given Megatron's
optimizer and scheduler, a checkpoint is loaded, the data is built from the resumed position,
and the loop runs.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from collections.abc import Sequence

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel as DDP
from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tokenizers import MegatronTokenizerBase
from megatron.core.transformer.module import Float16Module
from torch.utils.data import Dataset

from megatron_domino.config import DominoConfig
from megatron_domino.cpu_runtime import runtime_for_device
from megatron_domino.data.datasets import build_datasets, iterate_micro_batches
from megatron_domino.distributed import destroy_distributed, detect_launch, init_distributed
from megatron_domino.gpt_model import (
    GPTOptions,
    build_gpt_model,
    causal_attention_mask,
    padded_vocab_size,
)
from megatron_domino.training.arguments import (
    Layout,
    data_cache_path,
    domino_report_iters,
    lr_decay_iters,
    model_options,
    parse_args,
    tokenizer_from_args,
)
from megatron_domino.training.checkpointing import load_checkpoint, save_checkpoint
from megatron_domino.training.flops import gpt_training_flops
from megatron_domino.training.loop import StepShape, Trainer, train
from megatron_domino.training.reporting import Reporter, RunSummary


def pretrain(argv: Sequence[str] | None = None) -> RunSummary:
    """Run the job ``argv`` describes; every rank of the launch calls this.

    Returns:
        The run's summary (the same on every rank but for each rank's own ``--domino-report``
        timings; only rank 0 prints and writes logs).
    """
    args = parse_args(argv, world_size=detect_launch().world_size)
    with runtime_for_device():
        init_distributed(
            args.tensor_model_parallel_size,
            seed=args.seed,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        )
        try:
            return _run(args)
        finally:
            destroy_distributed()


def _run(args: argparse.Namespace) -> RunSummary:
    layout = Layout.from_args(args, torch.distributed.get_world_size())
    device = _device()
    tokenizer = tokenizer_from_args(args)
    options = model_options(args, vocab_size=tokenizer.vocab_size)
    model = build_gpt_model(options).to(device)
    domino = DominoConfig.from_args(args)
    with _domino_applied(model, domino) as domino_handle:
        wrapped, optimizer, scheduler = _wrap_for_training(args, model, layout)
        start = 0
        if args.load is not None:
            start = load_checkpoint(
                args.load,
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                iteration=args.ckpt_step,
            )
        reporter = _reporter(args, layout, options, resumed=start > 0)
        reporter.print(_banner(args, layout, domino, model, start))
        domino_report = None
        if args.domino_report:
            from megatron_domino.training.domino_report import (
                DominoOverlapReport,
                reported_iterations,
            )

            domino_report = DominoOverlapReport(
                domino_handle.runtime,
                reported_iterations(start + 1, args.train_iters, domino_report_iters(args)),
                reporter,
            )
        train_data, valid_data = _datasets(args, tokenizer, layout)
        micro_batches = functools.partial(
            iterate_micro_batches,
            micro_batch_size=args.micro_batch_size,
            data_parallel_rank=parallel_state.get_data_parallel_rank(),
            data_parallel_size=layout.data_parallel_size,
        )
        trainer = Trainer(
            model=wrapped,
            optimizer=optimizer,
            scheduler=scheduler,
            shape=StepShape(
                num_microbatches=layout.num_microbatches,
                micro_batch_size=args.micro_batch_size,
                seq_length=args.seq_length,
                global_batch_size=layout.global_batch_size,
            ),
            attention_mask=causal_attention_mask(args.seq_length, device),
            device=device,
        )

        def save(iteration: int) -> None:
            path = save_checkpoint(
                args.save, iteration, model=model, optimizer=optimizer, scheduler=scheduler
            )
            reporter.checkpoint_saved(iteration, path)

        train(
            trainer,
            reporter,
            first_iteration=start + 1,
            train_iters=args.train_iters,
            train_batches=micro_batches(
                train_data, consumed_samples=start * layout.global_batch_size
            ),
            eval_interval=args.eval_interval,
            eval_iters=args.eval_iters,
            valid_batches=lambda: micro_batches(valid_data),
            save_interval=args.save_interval,
            save=save if args.save is not None else None,
            domino_report=domino_report,
        )
        return reporter.finish()


def _wrap_for_training(
    args: argparse.Namespace, model: torch.nn.Module, layout: Layout
) -> tuple[DDP, MegatronOptimizer, OptimizerParamScheduler]:
    """Megatron-Core's DDP around the model (bf16 via ``Float16Module``), its optimizer and
    learning-rate scheduler, and the schedule's hooks connecting them."""
    wrapped = DDP(
        config=model.config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=args.bf16,
            overlap_grad_reduce=args.overlap_grad_reduce,
            use_distributed_optimizer=args.use_distributed_optimizer,
        ),
        module=Float16Module(model.config, model) if args.bf16 else model,
    )
    optimizer = get_megatron_optimizer(_optimizer_config(args), [wrapped])
    scheduler = _scheduler(args, optimizer, layout.global_batch_size)
    _wire_training_hooks(model, wrapped, optimizer, overlap=args.overlap_grad_reduce)
    return wrapped, optimizer, scheduler


def _datasets(
    args: argparse.Namespace, tokenizer: MegatronTokenizerBase, layout: Layout
) -> tuple[Dataset, Dataset | None]:
    """Train and validation datasets sized for this run (validation: one evaluation's worth,
    since every evaluation reads the same batches)."""
    evaluates = args.eval_interval is not None and args.eval_iters > 0
    train_data, valid_data, _ = build_datasets(
        tokenizer=tokenizer,
        sequence_length=args.seq_length,
        num_samples=(
            args.train_iters * layout.global_batch_size,
            args.eval_iters * layout.global_batch_size if evaluates else 0,
            0,
        ),
        seed=args.seed,
        path_to_cache=data_cache_path(args),
        data_path=args.data_path,
        split=args.split,
        mock_data=args.mock_data,
        eod_mask_loss=args.eod_mask_loss,
    )
    return train_data, valid_data


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def _domino_applied(model: torch.nn.Module, config: DominoConfig | None):
    """Domino on ``model`` for the body (nothing when ``--domino`` is off), reverted after;
    yields its handle (``None`` when off).

    Imported only when asked for, so a baseline run does not depend on Domino's modules.
    """
    if config is None:
        yield None
        return
    from megatron_domino.integration import apply_domino

    with apply_domino(model, config) as handle:
        yield handle


def _optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )


def _scheduler(
    args: argparse.Namespace, optimizer: MegatronOptimizer, global_batch_size: int
) -> OptimizerParamScheduler:
    """Megatron-LM's iteration-based schedule, counted in samples as it counts it."""
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * global_batch_size,
        lr_decay_steps=lr_decay_iters(args) * global_batch_size,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * global_batch_size,
        wd_incr_style="constant",
    )


def _wire_training_hooks(
    model: torch.nn.Module, wrapped: DDP, optimizer: MegatronOptimizer, *, overlap: bool
) -> None:
    """Point the schedule's hooks on the model config at DDP and the optimizer.

    ``get_forward_backward_func`` reads them from the config: the loss scale (bf16/fp16),
    the end-of-backward gradient reduction, and, when DDP overlaps its reduction with the
    backward pass, the context that holds it back until the last micro-batch.
    """
    config = model.config
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    if overlap:
        config.no_sync_func = wrapped.no_sync


def _reporter(
    args: argparse.Namespace, layout: Layout, options: GPTOptions, *, resumed: bool
) -> Reporter:
    flops = gpt_training_flops(
        batch_size=layout.global_batch_size,
        seq_length=args.seq_length,
        num_layers=options.num_layers,
        hidden_size=options.hidden_size,
        ffn_hidden_size=options.resolved_ffn_hidden_size,
        num_attention_heads=options.num_attention_heads,
        num_query_groups=options.resolved_num_query_groups,
        kv_channels=options.hidden_size // options.num_attention_heads,
        padded_vocab_size=padded_vocab_size(options.vocab_size, layout.tensor_parallel_size),
        swiglu=options.swiglu,
    )
    return Reporter(
        tokens_per_iteration=layout.global_batch_size * args.seq_length,
        flops_per_iteration=flops,
        world_size=layout.world_size,
        train_iters=args.train_iters,
        log_interval=args.log_interval,
        log_throughput=args.log_throughput,
        log_json=args.log_json,
        resumed=resumed,
        tensorboard_dir=args.tensorboard_dir,
        enabled=torch.distributed.get_rank() == 0,
    )


def _banner(
    args: argparse.Namespace,
    layout: Layout,
    domino: DominoConfig | None,
    model: torch.nn.Module,
    start: int,
) -> str:
    params = sum(p.numel() for p in model.parameters())
    lines = [
        f"world size {layout.world_size} = TP {layout.tensor_parallel_size} x PP "
        f"{layout.pipeline_parallel_size} x DP {layout.data_parallel_size}; global batch {layout.global_batch_size} = micro "
        f"{layout.micro_batch_size} x DP x {layout.num_microbatches} accumulation steps; "
        f"seq length {args.seq_length}",
        f"parameters on TP rank 0 of the first stage: {params:,}; Domino: "
        f"{domino if domino else 'off'}",
        f"resuming from iteration {start} of {args.load}"
        if start
        else f"training from scratch for {args.train_iters} iterations",
    ]
    return "\n".join(lines)
