"""Megatron DDP training of a model for the tests' comparisons with stock: two Adam steps
(Megatron's distributed optimizer) of two micro-batches each, DDP overlapping the gradient
reduction (``overlap_grad_reduce``), what each step computed, and the comparison of two such
runs to fp32 rounding (``tests/ranks/test_backward_order.py`` on ``GPTModel``,
``tests/ranks/test_domino_hybrid.py`` on ``HybridModel``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from lab.analysis.equivalence import TOLERANCES, token_batch
from lab.models.gpt_model import GPTOptions, build_gpt_model
from megatron_domino.apply import apply_domino
from megatron_domino.base.config import DominoConfig

MICRO_BATCHES, STEPS, LR = 2, 2, 1e-3
FP32 = TOLERANCES[torch.float32]


def hooked_bucket_groups(ddp, names: dict, log: list):
    """Record each bucket group's ``register_grad_ready`` calls of a last micro-batch (by
    parameter name) and its ``start_grad_sync`` calls, in order, into ``log``."""
    patches = contextlib.ExitStack()
    for number, group in enumerate(ddp.bucket_groups):
        register, start = group.register_grad_ready, group.start_grad_sync

        def registered(param, *args, register=register, group=group, **kwargs):
            if group.is_last_microbatch:
                log.append(("ready", names[param]))
            return register(param, *args, **kwargs)

        def started(*args, start=start, number=number, **kwargs):
            log.append(("sync", number))
            return start(*args, **kwargs)

        group.register_grad_ready, group.start_grad_sync = registered, started
        patches.callback(setattr, group, "register_grad_ready", register)
        patches.callback(setattr, group, "start_grad_sync", start)
    return patches


def train_ddp(
    options: GPTOptions,
    config: DominoConfig | None,
    build: Callable[[GPTOptions], torch.nn.Module] = build_gpt_model,
) -> dict:
    """The model ``build`` makes of ``options``, in Megatron DDP (``overlap_grad_reduce``, the
    distributed optimizer), trained :data:`STEPS` Adam steps of :data:`MICRO_BATCHES`
    micro-batches, with Domino's ``config`` applied (stock for ``None``): per step the losses,
    every ``main_grad`` after ``finalize_model_grads``, the log of the DDP bucket groups of the
    last micro-batch's backward (:func:`hooked_bucket_groups`) and their count; the weights at
    the end."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    torch.manual_seed(0)  # the same initial weights in every arm
    model = build(options)
    ddp = DistributedDataParallel(
        config=model.config,
        ddp_config=DistributedDataParallelConfig(
            overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=20000
        ),
        module=model,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=LR, use_distributed_optimizer=True), [ddp]
    )
    names = {param: name for name, param in model.named_parameters()}
    handle = apply_domino(ddp, config) if config is not None else contextlib.nullcontext()
    steps = []
    with handle:
        for step in range(STEPS):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            losses, log = [], []
            for micro_batch in range(MICRO_BATCHES):
                last = micro_batch == MICRO_BATCHES - 1
                with (
                    contextlib.nullcontext() if last else ddp.no_sync(),
                    hooked_bucket_groups(ddp, names, log),
                ):
                    loss = ddp(**token_batch(options, 4, seed=10 * step + micro_batch)).mean()
                    loss.backward()
                    if last:
                        log.append(("backward done", None))
                losses.append(loss.item())
            finalize_model_grads([ddp])
            grads = {names[p]: p.main_grad.clone() for p in model.parameters()}
            assert optimizer.step()[0]
            steps.append(dict(losses=losses, grads=grads, log=log, buckets=len(ddp.bucket_groups)))
    weights = {name: param.detach().clone() for name, param in model.named_parameters()}
    return dict(steps=steps, weights=weights)


def differences(run: dict, reference: dict) -> list[str]:
    """Where ``run`` differs from ``reference`` beyond fp32 rounding: losses and main_grads per
    step element-wise within the suite's fp32 tolerance (``TOLERANCES``); the weights after
    Adam within a hundredth of its learning rate (Adam divides each gradient element by its
    own running norm, so rounding in a near-zero element moves a weight by up to ``lr``)."""
    found = []
    steps = list(zip(run["steps"], reference["steps"], strict=True))
    pairs = [
        (f"step {i} {name}", step["grads"][name], ref["grads"][name], FP32)
        for i, (step, ref) in enumerate(steps)
        for name in ref["grads"]
    ]
    pairs += [
        (f"step {i} losses", torch.tensor(step["losses"]), torch.tensor(ref["losses"]), FP32)
        for i, (step, ref) in enumerate(steps)
    ]
    pairs += [
        (f"weight {name}", run["weights"][name], weight, dict(rtol=0.0, atol=1e-2 * LR))
        for name, weight in reference["weights"].items()
    ]
    for what, actual, expected, tolerance in pairs:
        if not torch.allclose(actual, expected, **tolerance):
            found.append(f"{what}: max diff {float((actual - expected).abs().max()):.2e}")
    return found
