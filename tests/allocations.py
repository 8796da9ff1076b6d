"""Test support: which large boolean tensors a piece of code creates, seen at the dispatcher.

A dense ``[1, 1, s, s]`` attention mask is ``s**2`` bytes whoever builds it (``torch.ones`` +
``triu``, a helper of Megatron's or of Domino's). :class:`BoolTensors` is a
``TorchDispatchMode`` that records every boolean tensor with at least ``s`` rows and ``s``
columns in its last two dimensions that any aten op returns while it is active (views
included), so a test can assert that no mask of that size was created, without knowing where
it would have come from. (A chunk's mask rows ``[s/p, (c+1)s/p]`` have fewer rows.)
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class BoolTensors(TorchDispatchMode):
    """Records ``(op, shape)`` of each boolean ``[..., >= s, >= s]`` tensor an op returns."""

    def __init__(self, s: int) -> None:
        super().__init__()
        self.s = s
        self.found: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if (
                isinstance(leaf, torch.Tensor)
                and leaf.dtype == torch.bool
                and leaf.dim() >= 2
                and min(leaf.shape[-2:]) >= self.s
            ):
                self.found.append((str(func), tuple(leaf.shape)))
        return out
