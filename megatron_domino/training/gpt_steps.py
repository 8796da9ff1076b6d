"""The GPT-specific callbacks Megatron-LM's ``pretrain()`` takes: data, forward step, loss.

Megatron-LM keeps these in its repository's ``pretrain_gpt.py``, which the ``megatron-core``
wheel does not ship, so this module provides them for dense GPT pretraining, built from
Megatron-Core's and ``megatron.training``'s own pieces (``GPTDataset`` / ``MockGPTDataset``
through ``BlendedMegatronDatasetBuilder``, ``get_batch_on_this_tp_rank``, the rerun state
machine's NaN checks) and with Megatron-LM's semantics:

* data is read on TP rank 0 of the first and last pipeline stages and broadcast to the other
  TP ranks; middle stages read nothing (their input comes from the previous stage);
* the loss of a micro-batch is reported as ``[sum of token losses, token count]``, which
  Megatron's ``train_step`` sums over micro-batches and data-parallel ranks before dividing:
  the mean over all unmasked tokens of the global batch, however the batch was split.

Megatron-LM features of ``pretrain_gpt.py`` that this path does not implement are refused by
:func:`unsupported_flags` (SFT, FIM data, packed sequences, context parallelism, ...): use
Megatron-LM's own script with the patch in ``patches/`` for those.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.utils import get_batch_on_this_tp_rank
from megatron.training import get_args, get_timers, get_tokenizer, print_rank_0
from megatron.training.utils import get_blend_and_blend_per_split

__all__ = ["forward_step", "train_valid_test_datasets_provider", "unsupported_flags"]

#: Batch fields a GPT micro-batch carries ([b, s] each; the mask [b, 1, s, s] when created).
_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")

#: (argument, is-set predicate, flag) for pretrain_gpt.py features this path does not have.
_UNSUPPORTED = (
    ("sft", bool, "--sft"),
    ("fim_data", bool, "--fim-data"),
    ("dataloader_inter_document_masking", bool, "--dataloader-inter-document-masking"),
    ("context_parallel_size", lambda v: (v or 1) > 1, "--context-parallel-size > 1"),
    ("hybrid_context_parallel", bool, "--hybrid-context-parallel"),
    ("mtp_num_layers", lambda v: v is not None, "--mtp-num-layers"),
    ("logits_load_dir", lambda v: v is not None, "--logits-load-dir"),
    ("per_dataset_sequences_path", lambda v: v is not None, "--per-dataset-sequences-path"),
    ("num_experts", lambda v: v is not None, "--num-experts"),
    ("overlap_moe_expert_parallel_comm", bool, "--overlap-moe-expert-parallel-comm"),
)


def unsupported_flags(args: argparse.Namespace) -> list[str]:
    """The flags in ``args`` that this dense-GPT path does not implement (empty if none)."""
    return [flag for name, is_set, flag in _UNSUPPORTED if is_set(getattr(args, name, None))]


def _is_data_stage() -> bool:
    return mpu.is_pipeline_first_stage() or mpu.is_pipeline_last_stage()


def _get_batch(data_iterator) -> dict[str, torch.Tensor | None]:
    """This rank's micro-batch: read on TP rank 0, broadcast over the TP group."""
    if not _is_data_stage():
        return dict.fromkeys(_BATCH_KEYS)
    args = get_args()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        raw = next(data_iterator)
        batch = {k: raw[k].cuda(non_blocking=True) if k in raw else None for k in _BATCH_KEYS}
    return get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=1,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )


def _loss_func(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """Masked token-loss sum, token count, and both for Megatron's cross-rank report.

    Args:
        loss_mask: ``[b, s]``, 1 where a token counts.
        per_token_loss: ``[b, s]`` from the model's last stage.
    """
    args = get_args()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(per_token_loss.view(-1).float() * mask)
    num_tokens = mask.sum().to(torch.int)
    if args.check_for_nan_in_loss_and_grad:
        for rejected, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            get_rerun_state_machine().validate_result(
                result=loss,
                rejection_func=rejected,
                message=f"found {what} in local forward loss calculation",
                tolerance=0.0,
                fatal=True,
            )
    report = torch.stack([loss.detach(), num_tokens.detach().float()])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    """Megatron's ``forward_step_func``: one micro-batch through ``model`` (one stage).

    Returns the per-token loss ``[b, s]`` on the last stage (the hidden states ``[s, b, h]``
    on others) and the loss function bound to this micro-batch's mask.
    """
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    batch = _get_batch(data_iterator)
    timers("batch-generator").stop()
    output = model(
        batch["tokens"],
        batch["position_ids"],
        batch["attention_mask"],
        labels=batch["labels"],
    )
    return output, partial(_loss_func, batch["loss_mask"])


#: GPTDatasetConfig fields that Megatron-LM's arguments hold under the same name.
_SAME_NAMED_ARGS = """
    split multiple_validation_sets full_validation num_dataset_builder_threads mmap_bin_files
    reset_position_ids reset_attention_mask eod_mask_loss object_storage_cache_path
    mid_level_dataset_surplus allow_ambiguous_pad_tokens data_parallel_size
""".split()


def _dataset_config(args: argparse.Namespace) -> GPTDatasetConfig:
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        **{name: getattr(args, name) for name in _SAME_NAMED_ARGS},
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        path_to_cache=args.data_cache_path,
        tokenizer=get_tokenizer(),
        create_attention_mask=args.create_attention_mask_in_dataloader,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel,
    )


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's dataset provider: GPT datasets for the sample counts it asks for.

    Built on TP rank 0 of the stages that read data (``is_distributed``: Megatron calls it
    on every rank and lets the builder decide).
    """
    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = BlendedMegatronDatasetBuilder(
        dataset_type,
        train_val_test_num_samples,
        lambda: mpu.get_tensor_model_parallel_rank() == 0 and _is_data_stage(),
        _dataset_config(args),
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


train_valid_test_datasets_provider.is_distributed = True
