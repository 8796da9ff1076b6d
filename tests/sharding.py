"""Test support: cut a full (TP = 1) GPTModel state into the shards of a tensor-parallel model.

Equivalence tests build a model at TP = 1, then load the very same weights into every rank of
a TP = N model and compare outputs and gradients. Megatron-Core records on each parameter how
it is split: ``tensor_model_parallel`` (split or replicated), ``partition_dim`` and
``partition_stride``. For the local layer spec that means:

* **Column-parallel** weights ``[out, in]`` and their biases ``[out]`` split on dim 0 (QKV,
  fc1, the untied output layer), and so does the word embedding ``[V_pad, h]`` on its
  vocabulary dim.
* **Row-parallel** weights ``[out, in]`` split on dim 1 (attention output projection, fc2);
  their biases, the norms and the position embedding are replicated.
* **Fused QKV with GQA** ``[ng * (np/ng + 2) * hn, h]`` is laid out group by group, each
  group's ``np/ng`` query heads followed by its key and value head. Rank r owns groups
  ``r*ng/TP .. (r+1)*ng/TP - 1``, a contiguous block of rows, so a plain dim-0 split is right.
  (Weights with separate Q, K and V, as in other frameworks, would first need interleaving.)
* **SwiGLU fc1** ``[2f, h]`` is ``[gate; up]`` at TP = 1, but each rank stores
  ``[gate_r; up_r]``. Megatron marks it with ``partition_stride = 2``: cut dim 0 into
  ``2 * TP`` blocks and rank r takes blocks r and TP + r.

Gradients are split exactly like their parameters, so :func:`shard_like` also maps a TP = 1
gradient onto a rank's gradient for comparison.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["shard_like", "shard_state_dict", "shard_tensor"]


def shard_tensor(
    full: torch.Tensor, *, dim: int, stride: int, rank: int, world_size: int
) -> torch.Tensor:
    """The part of ``full`` that TP rank ``rank`` of ``world_size`` holds.

    ``full`` is cut along ``dim`` into ``stride * world_size`` equal blocks; the rank takes
    blocks ``rank, rank + world_size, ...`` (``stride`` of them), concatenated. ``stride`` 1 is
    a plain contiguous split.
    """
    blocks = stride * world_size
    if full.shape[dim] % blocks:
        raise ValueError(
            f"dim {dim} of a {tuple(full.shape)} tensor does not split into {blocks} equal "
            f"blocks (stride {stride} x TP {world_size})."
        )
    chunks = torch.chunk(full, blocks, dim=dim)
    return torch.cat(chunks[rank::world_size], dim=dim)


def shard_like(
    full: torch.Tensor, local: torch.Tensor, *, rank: int, world_size: int
) -> torch.Tensor:
    """The part of ``full`` (a TP = 1 parameter or gradient) that corresponds to ``local``.

    ``local`` is the TP-rank parameter, or any tensor carrying its partition attributes; a
    replicated one (``tensor_model_parallel`` unset or False) gets a copy of ``full``.
    """
    if getattr(local, "tensor_model_parallel", False):
        shard = shard_tensor(
            full,
            dim=local.partition_dim,
            stride=local.partition_stride,
            rank=rank,
            world_size=world_size,
        )
    else:
        shard = full.clone()
    if shard.shape != local.shape:
        raise ValueError(
            f"the shard for TP rank {rank} of {world_size} is {tuple(shard.shape)}, "
            f"the model holds {tuple(local.shape)}."
        )
    return shard


def shard_state_dict(
    full_state: Mapping[str, object],
    model: torch.nn.Module,
    *,
    rank: int,
    world_size: int,
) -> dict[str, object]:
    """Map a full model's ``state_dict()`` onto ``model``, the shard of TP rank ``rank``.

    Args:
        full_state: ``state_dict()`` of the same model built at TP = 1 (with the same padded
            vocabulary size; pick a vocabulary whose padding does not depend on TP).
        model: the TP-rank model; its parameters carry Megatron's partition attributes.
        rank: this rank's index in the TP group.
        world_size: TP group size.
    Returns:
        A state dict for ``model.load_state_dict``: :func:`shard_like` of every tensor, and
        non-tensor entries (``_extra_state``) as given.
    Raises:
        KeyError: ``model`` has an entry ``full_state`` lacks.
        ValueError: a shard's shape differs from the model's tensor (the message names it).
    """
    sharded: dict[str, object] = {}
    for name, local in model.state_dict(keep_vars=True).items():
        full = full_state[name]
        if not isinstance(local, torch.Tensor):
            sharded[name] = full
            continue
        try:
            sharded[name] = shard_like(full, local, rank=rank, world_size=world_size)
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from err
    return sharded
