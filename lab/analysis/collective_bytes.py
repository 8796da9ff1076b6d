"""Bytes each kind of tensor-parallel collective moves, counted where every caller meets.

Megatron-Core binds its all-gather and reduce-scatter functions at import
(``tensor_parallel/mappings.py``), Domino calls ``torch.distributed`` at call time, Transformer
Engine has its own wrappers: patching one name misses the others. All of them end in the
``c10d`` dispatcher ops, which a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees
(on the thread it is entered on, where CPU autograd also runs the backward). Counted per op
is the payload one rank contributes or receives: an all-reduce's tensor, an all-gather's
output, a reduce-scatter's input (the ring moves ``(tp-1)/tp`` of that over each link, for
stock and Domino alike).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CollectiveBytes"]


def _nbytes(payload) -> int:
    """Bytes of a tensor or a (nested) list of them; 0 for anything else."""
    if isinstance(payload, torch.Tensor):
        return payload.numel() * payload.element_size()
    if isinstance(payload, (list, tuple)):
        return sum(_nbytes(item) for item in payload)
    return 0


#: c10d op name -> (kind, which argument holds the payload).
_PAYLOAD = {
    "allreduce_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
}


class CollectiveBytes(TorchDispatchMode):
    """While entered: ``bytes[kind]`` and ``calls[kind]`` of every collective launched
    (``kind``: ``all_reduce``, ``all_gather``, ``reduce_scatter``; any other c10d op is
    counted under its own name)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func._schema.name.split("::")[-1]
            kind, index = _PAYLOAD.get(name, (name, 0))
            self.bytes[kind] += _nbytes(args[index]) if args else 0
            self.calls[kind] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.bytes.values())
