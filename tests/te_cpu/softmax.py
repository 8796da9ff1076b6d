"""TE's fused softmax kernels (``tex.scaled_*softmax_forward/backward``), used by its unfused
attention (``attention/dot_product_attention/softmax.py``) when the shape fits them.

Each forward is ``softmax(scale * x)`` over the last dimension, computed in fp32 and returned in
``x``'s dtype, with the kernel's mask: none; ``mask`` (True = masked, broadcast over batch and
heads: the element becomes -10000 before the softmax, as the CUDA kernel fills it);
the upper triangle (``[batches, sq, sk]``: key ``j > i`` gets probability 0); or causal aligned
to the bottom-right corner (``[b, h, sq, sk]``: ``j > i + sk - sq`` gets 0). Every backward is
``scale * y * (dy - sum(dy * y))`` from the saved probabilities ``y``.
"""

from __future__ import annotations

import torch

__all__ = [
    "scaled_aligned_causal_masked_softmax_backward",
    "scaled_aligned_causal_masked_softmax_forward",
    "scaled_masked_softmax_backward",
    "scaled_masked_softmax_forward",
    "scaled_softmax_backward",
    "scaled_softmax_forward",
    "scaled_upper_triang_masked_softmax_backward",
    "scaled_upper_triang_masked_softmax_forward",
]

_MASKED_VALUE = -10000.0


def _causal(x: torch.Tensor, offset: int) -> torch.Tensor:
    """True where key ``j > i + offset`` (masked) for ``x`` ``[..., sq, sk]``."""
    sq, sk = x.shape[-2:]
    rows = torch.arange(sq).unsqueeze(1)
    return torch.arange(sk).unsqueeze(0) > rows + offset


def _softmax(x: torch.Tensor, scale, *, fill=None, drop=None) -> torch.Tensor:
    scores = x.float() * float(scale)
    if fill is not None:
        scores = scores.masked_fill(fill, _MASKED_VALUE)
    if drop is not None:
        scores = scores.masked_fill(drop, float("-inf"))
    return torch.softmax(scores, dim=-1).to(x.dtype)


def _backward(dy: torch.Tensor, y: torch.Tensor, scale) -> torch.Tensor:
    y32, dy32 = y.float(), dy.float()
    return (float(scale) * y32 * (dy32 - (dy32 * y32).sum(-1, keepdim=True))).to(dy.dtype)


def scaled_softmax_forward(x, scale):
    return _softmax(x, scale)


def scaled_masked_softmax_forward(x, mask, scale):
    return _softmax(x, scale, fill=mask.bool())


def scaled_upper_triang_masked_softmax_forward(x, scale):
    return _softmax(x, scale, drop=_causal(x, 0))


def scaled_aligned_causal_masked_softmax_forward(x, scale):
    return _softmax(x, scale, drop=_causal(x, x.shape[-1] - x.shape[-2]))


scaled_softmax_backward = _backward
scaled_masked_softmax_backward = _backward
scaled_upper_triang_masked_softmax_backward = _backward
scaled_aligned_causal_masked_softmax_backward = _backward
