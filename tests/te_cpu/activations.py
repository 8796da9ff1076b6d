"""TE's activation kernels (``tex.gelu/swiglu/geglu/relu/reglu`` and their ``d*`` backwards),
used by TE's activation ops (``ops/basic/activation.py``, ``ops/basic/swiglu.py``), which
Megatron-Core builds with ``use_te_activation_func``.

Computed in fp32 and returned in the input's dtype, or cast by the ``quantizer`` TE passes
(the next op's input quantizer). The gated forms take ``[..., 2n]`` and activate the first half:
``act(x[..., :n]) * x[..., n:]``. TE's GELU is the tanh approximation (``common/util/math.h``).
"""

from __future__ import annotations

import torch

from te_cpu import fp8

__all__ = [
    "dgeglu",
    "dgelu",
    "dreglu",
    "drelu",
    "dswiglu",
    "geglu",
    "gelu",
    "reglu",
    "relu",
    "swiglu",
]


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


_ACTIVATIONS = {"gelu": _gelu, "silu": torch.nn.functional.silu, "relu": torch.relu}


def _apply(function, x: torch.Tensor, quantizer, *, gated: bool) -> torch.Tensor:
    x32 = x.float()
    if gated:
        gate, linear = x32.chunk(2, dim=-1)
        y = function(gate) * linear
    else:
        y = function(x32)
    return y.to(x.dtype) if quantizer is None else fp8.quantize(y.to(x.dtype), quantizer)


def _gradient(function, dy: torch.Tensor, x: torch.Tensor, quantizer, *, gated: bool):
    """``dx`` of :func:`_apply` by autograd on the fp32 forward."""
    x32 = x.detach().float().requires_grad_(True)
    with torch.enable_grad():
        if gated:
            gate, linear = x32.chunk(2, dim=-1)
            y = function(gate) * linear
        else:
            y = function(x32)
        (dx,) = torch.autograd.grad(y, x32, dy.float())
    return dx.to(x.dtype) if quantizer is None else fp8.quantize(dx.to(x.dtype), quantizer)


def gelu(x, quantizer):
    return _apply(_ACTIVATIONS["gelu"], x, quantizer, gated=False)


def relu(x, quantizer):
    return _apply(_ACTIVATIONS["relu"], x, quantizer, gated=False)


def geglu(x, quantizer):
    return _apply(_ACTIVATIONS["gelu"], x, quantizer, gated=True)


def swiglu(x, quantizer):
    return _apply(_ACTIVATIONS["silu"], x, quantizer, gated=True)


def reglu(x, quantizer):
    return _apply(_ACTIVATIONS["relu"], x, quantizer, gated=True)


def dgelu(dy, x, quantizer):
    return _gradient(_ACTIVATIONS["gelu"], dy, x, quantizer, gated=False)


def drelu(dy, x, quantizer):
    return _gradient(_ACTIVATIONS["relu"], dy, x, quantizer, gated=False)


def dgeglu(dy, x, quantizer):
    return _gradient(_ACTIVATIONS["gelu"], dy, x, quantizer, gated=True)


def dswiglu(dy, x, quantizer):
    return _gradient(_ACTIVATIONS["silu"], dy, x, quantizer, gated=True)


def dreglu(dy, x, quantizer):
    return _gradient(_ACTIVATIONS["relu"], dy, x, quantizer, gated=True)
