"""TE's fused LayerNorm and RMSNorm (``tex.layernorm_fwd/bwd``, ``tex.rmsnorm_fwd/bwd``).

The kernels of ``pytorch/csrc/extensions/normalization.cpp`` as torch ops over
``[rows, h]`` (every leading dimension flattened into rows):

* statistics in fp32: LayerNorm ``mu`` and ``rsigma = 1/sqrt(var + eps)``, RMSNorm
  ``rsigma = 1/sqrt(mean(x^2) + eps)``, each ``[rows]``, saved by TE for backward;
* ``zero_centered_gamma``: the weight is applied as ``1 + gamma``;
* the output: without a quantizer in ``otype``; with a delayed-scaling ``Float8Quantizer``
  the **fp32** result cast straight to FP8 (TE's FULLY_FUSED path: one rounding, the amax
  taken from fp32 values); with a current-scaling quantizer, the result rounded to ``otype``
  and then cast (TE's FUSED_NORM_AMAX_FP8 path computes the amax beside the unquantized
  output); into ``ln_out`` when TE passes a buffer.

The backward returns ``dx`` in the input's dtype and ``dgamma`` (``dbeta``) in the weight's.
"""

from __future__ import annotations

import torch

from te_cpu import fp8
from te_cpu.enums import TORCH_DTYPE, DType

__all__ = ["layernorm_bwd", "layernorm_fwd", "rmsnorm_bwd", "rmsnorm_fwd"]


def _gamma(weight: torch.Tensor, zero_centered_gamma: bool) -> torch.Tensor:
    return weight.float() + 1.0 if zero_centered_gamma else weight.float()


def _finish(y: torch.Tensor, shape, out, quantizer, otype):
    """The norm's fp32 result ``y`` ``[rows, h]`` as TE returns it (module docstring)."""
    y = y.reshape(shape)
    dtype = TORCH_DTYPE[DType(int(otype))]
    if quantizer is None:
        if out is None:
            return y.to(dtype)
        out.copy_(y)
        return out
    fused = type(quantizer).__name__ == "Float8Quantizer"
    source = y if fused else y.to(dtype)
    if out is None:
        out = fp8.create_empty_quantized_tensor(quantizer, shape, dtype, y.device)
    return fp8.quantize(source, quantizer, output=out)


def layernorm_fwd(
    input, weight, bias, eps, ln_out, quantizer, otype, sm_margin, zero_centered_gamma
):
    """``(output, mu [rows], rsigma [rows])``."""
    x = input.reshape(-1, input.shape[-1]).float()
    mu = x.mean(dim=1)
    rsigma = torch.rsqrt(((x - mu[:, None]) ** 2).mean(dim=1) + eps)
    y = (x - mu[:, None]) * rsigma[:, None] * _gamma(weight, zero_centered_gamma)
    if bias is not None:
        y = y + bias.float()
    return [_finish(y, input.shape, ln_out, quantizer, otype), mu, rsigma]


def rmsnorm_fwd(input, weight, eps, ln_out, quantizer, otype, sm_margin, zero_centered_gamma):
    """``(output, None, rsigma [rows])``."""
    x = input.reshape(-1, input.shape[-1]).float()
    rsigma = torch.rsqrt((x * x).mean(dim=1) + eps)
    y = x * rsigma[:, None] * _gamma(weight, zero_centered_gamma)
    return [_finish(y, input.shape, ln_out, quantizer, otype), None, rsigma]


def layernorm_bwd(dz, x, mu, rsigma, gamma, sm_margin, zero_centered_gamma):
    """``(dx, dgamma, dbeta)`` of :func:`layernorm_fwd`."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    dz2 = dz.reshape(x2.shape).float()
    xhat = (x2 - mu[:, None]) * rsigma[:, None]
    dxhat = dz2 * _gamma(gamma, zero_centered_gamma)
    dx = rsigma[:, None] * (
        dxhat - dxhat.mean(dim=1, keepdim=True) - xhat * (dxhat * xhat).mean(dim=1, keepdim=True)
    )
    dgamma = (dz2 * xhat).sum(0)
    dbeta = dz2.sum(0)
    return [dx.to(x.dtype).reshape(x.shape), dgamma.to(gamma.dtype), dbeta.to(gamma.dtype)]


def rmsnorm_bwd(dz, x, rsigma, gamma, sm_margin, zero_centered_gamma):
    """``(dx, dgamma)`` of :func:`rmsnorm_fwd`."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    dz2 = dz.reshape(x2.shape).float()
    xhat = x2 * rsigma[:, None]
    dxhat = dz2 * _gamma(gamma, zero_centered_gamma)
    dx = rsigma[:, None] * (dxhat - xhat * (dxhat * xhat).mean(dim=1, keepdim=True))
    dgamma = (dz2 * xhat).sum(0)
    return [dx.to(x.dtype).reshape(x.shape), dgamma.to(gamma.dtype)]
