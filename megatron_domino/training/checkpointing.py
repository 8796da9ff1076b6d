"""Save and resume training state with ``megatron.core.dist_checkpointing``.

A checkpoint holds everything that decides the next iteration, so that a resumed run computes
exactly the losses the uninterrupted run would have: the model and optimizer (as sharded
tensors, so every TP rank writes only its shard), the learning-rate scheduler, the iteration
(from which the data position follows), and every random generator's state (Python, NumPy,
torch, CUDA if present, and Megatron's tensor-parallel RNG tracker), one copy per pipeline
stage and TP rank.

The layout follows Megatron-LM's, so its tools recognise it: ``<root>/iter_0000100/`` per
checkpoint and ``<root>/latest_checkpointed_iteration.txt`` naming the newest complete one,
written only after every rank has finished saving.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer import DistributedOptimizer, MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

TRACKER_FILE = "latest_checkpointed_iteration.txt"

#: How model and optimizer describe their shards; Megatron-LM's defaults for the torch_dist
#: format. The distributed optimizer's own default layout (``fully_sharded_model_space``) is
#: deprecated and fails to save in Megatron-Core 0.16; ``dp_reshardable`` stores each DP
#: rank's contiguous buffers as they are, resumable at any DP size with the same TP size.
SHARDING_METADATA = {
    "distrib_optim_sharding_type": "dp_reshardable",
    "singleton_local_shards": False,
    "chained_optim_avoid_prefix": True,
}


class CheckpointError(RuntimeError):
    """A checkpoint that was asked for cannot be found or read."""


def checkpoint_path(root: str, iteration: int) -> str:
    """The directory of the checkpoint taken after ``iteration``."""
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_iteration(root: str) -> int | None:
    """The iteration of the newest complete checkpoint under ``root``, or None if there is none."""
    try:
        with open(os.path.join(root, TRACKER_FILE), encoding="utf-8") as tracker:
            return int(tracker.read().strip())
    except FileNotFoundError:
        return None


def save_checkpoint(
    root: str,
    iteration: int,
    *,
    model: torch.nn.Module,
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
) -> str:
    """Write the state after ``iteration`` to ``root``; collective over all ranks.

    Returns:
        The checkpoint's directory.
    """
    path = checkpoint_path(root, iteration)
    if torch.distributed.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    state = _sharded_state_dict(model, optimizer, scheduler, iteration, is_loading=False)
    dist_checkpointing.save(state, path)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        staged = os.path.join(root, TRACKER_FILE + ".tmp")
        with open(staged, "w", encoding="utf-8") as tracker:
            tracker.write(f"{iteration}\n")
        os.replace(staged, os.path.join(root, TRACKER_FILE))
    torch.distributed.barrier()
    return path


@torch.no_grad()
def load_checkpoint(
    root: str,
    *,
    model: torch.nn.Module,
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    iteration: int | None = None,
) -> int:
    """Restore the state saved under ``root``; collective over all ranks.

    Args:
        iteration: the checkpoint to load; by default the newest complete one.
    Returns:
        The iteration the checkpoint was taken after, or 0 when ``root`` holds no checkpoint
        and ``iteration`` was not given (training then starts from scratch).

    Runs without autograd: the distributed optimizer copies fp32 parameters in place through
    views of the model's parameters, which autograd refuses for leaves that require grad.
    """
    if iteration is None:
        iteration = latest_iteration(root)
        if iteration is None:
            return 0
    path = checkpoint_path(root, iteration)
    if not os.path.isdir(path):
        raise CheckpointError(
            f"--load {root}: no checkpoint for iteration {iteration} ({path} does not exist)."
        )
    with _torch_adam_distributed_optimizer_loadable(optimizer):
        template = _sharded_state_dict(model, optimizer, scheduler, iteration, is_loading=True)
        state = dist_checkpointing.load(template, path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["opt_param_scheduler"])
    _restore_rng_state(state["rng_state"])
    return state["iteration"]


@contextlib.contextmanager
def _torch_adam_distributed_optimizer_loadable(optimizer: MegatronOptimizer) -> Iterator[None]:
    """Work around Megatron-Core 0.16 loading a ``DistributedOptimizer`` over torch's Adam.

    That is the path without Transformer Engine or Apex, so every CPU run; it has two faults:

    * ``DistributedOptimizer.state_dict()`` reads each parameter's ``step`` from the inner
      Adam, which creates it only at its first step, so a fresh optimizer cannot even build
      the loading template. Megatron-Core's own remedy elsewhere (its fully-reshardable
      format) is one step with zero gradients; the checkpoint then overwrites what it changed.
    * Loading copies the template's non-persistent ``step`` over the restored one and leaves
      one step tensor shared by all parameters, which Adam then increments once per parameter.
      The checkpointed step survives in the param groups; each parameter gets its own copy.
    """
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    torch_adams = [
        inner
        for inner in chained
        if isinstance(inner, DistributedOptimizer) and isinstance(inner.optimizer, torch.optim.Adam)
    ]
    for inner in torch_adams:
        if not inner.optimizer.state:
            inner._init_optimizer_states_with_dummy_values()
    yield
    for inner in torch_adams:
        for group in inner.optimizer.param_groups:
            for param in group["params"]:
                step = torch.tensor(float(group["step"]), dtype=torch.float32)
                inner.optimizer.state[param]["step"] = step


def _sharded_state_dict(
    model: torch.nn.Module,
    optimizer: MegatronOptimizer,
    scheduler: OptimizerParamScheduler,
    iteration: int,
    *,
    is_loading: bool,
) -> dict:
    """The checkpoint's layout: sharded model and optimizer, common scheduler and iteration."""
    model_state = model.sharded_state_dict(metadata=dict(SHARDING_METADATA))
    return {
        "iteration": iteration,
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=dict(SHARDING_METADATA)
        ),
        "opt_param_scheduler": scheduler.state_dict(),
        "rng_state": _rng_state(),
    }


def _rng_state() -> ShardedObject:
    """This rank's generator states, stored once per (pipeline stage, TP rank); data-parallel
    ranks share them.

    TP ranks differ (Megatron seeds the tensor-parallel tracker per TP rank, e.g. for dropout
    inside a TP region), and so do pipeline stages (they run different layers); data-parallel
    replicas run the same ops from the same seeds, so the first one's copy stands for all.
    """
    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return ShardedObject(
        "rng_state",
        state,
        (
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_world_size(),
        ),
        (
            parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_rank(),
        ),
        replica_id=parallel_state.get_data_parallel_rank(),
    )


def _restore_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
