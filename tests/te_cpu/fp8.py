"""FP8 tensors for Transformer Engine's own Python: creation, casts, transposes, scale updates.

What TE's compiled extension does for per-tensor FP8 (``Float8Quantizer``: delayed scaling;
``Float8CurrentScalingQuantizer``: current scaling), written from TE 2.18's sources
(``pytorch/csrc/quantizer.cpp``, ``csrc/extensions/cast.cpp``, ``common/recipe/``) as torch
ops, for an H100 (sm_90):

* **Storage.** An FP8 tensor holds row-wise bits ``_data`` (``uint8``, the tensor's shape)
  and/or column-wise bits ``_transpose`` (``uint8``, ``[last] + rest``), and one
  ``_scale_inv`` ``[1]``; Hopper's GEMM reads only "TN" FP8 operands, so a tensor has the
  row-wise bits only when its quantizer asks for row-wise usage, the transpose only for
  column-wise usage (``nvte_is_non_tn_fp8_gemm_supported()`` is false on sm_90).
  ``quantizer.internal`` selects a ``Float8TensorStorage`` (no ``torch.Tensor``), else a
  ``Float8Tensor``. Block scaling (``Float8BlockQuantizer``) is :mod:`te_cpu.blockwise`'s.
* **Casts** round to nearest even and saturate to the format's largest finite value (CUDA's
  ``__NV_SATFINITE``; torch's own cast would give NaN for E4M3). Delayed scaling multiplies by
  the quantizer's ``scale`` and takes the running maximum of ``|x|`` into ``quantizer.amax``
  (a slot of the amax history: several casts in one autocast accumulate the maximum, as the
  kernel's atomic max does). Current scaling computes ``amax = max |x|`` per call, reduces it
  with MAX over ``amax_reduction_group`` when the quantizer says so, and casts with
  ``fp8_max / max(amax, epsilon)`` (1 when amax is 0, inf or NaN; optionally a power of 2).
* **The scale update** after an autocast (``fused_amax_and_scale_update_after_reduction``):
  the reduced amaxes go to row 0 of each history, the amax used is the history's maximum or its
  most recent row, the history rolls by one row and its row 0 is zeroed for the next window, and
  ``scale = fp8_max / amax / 2^margin`` where amax is positive and finite (else the old scale;
  fp32's max where it overflows).

Kernel numerics are only modelled: a GPU decides them (``tests/gpu/``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from te_cpu import blockwise
from te_cpu.enums import FP8_MAX, TORCH_DTYPE, DType

__all__ = [
    "bgrad_quantize",
    "compute_amax",
    "create_empty_quantized_tensor",
    "dequantize",
    "fp8_transpose",
    "fused_amax_and_scale_update_after_reduction",
    "quantize",
    "swap_first_dims",
    "values",
]

_FP32_MAX = torch.finfo(torch.float32).max


def swap_first_dims(tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``tensor`` ``[a, b, ...]`` as ``[b, a, ...]`` (into ``out`` when given): TE's FP8 block
    all-gather puts each rank's rows of a transposed buffer back in order with it
    (``pytorch/distributed.py``, ``_finish_all_gather_fp8_blockwise``)."""
    swapped = tensor.transpose(0, 1)
    if out is None:
        return swapped.contiguous()
    return out.copy_(swapped)


def _transpose_shape(shape) -> list[int]:
    """TE's column-wise shape: the last dimension first (``make_transpose_shape``)."""
    shape = list(shape)
    return shape[-1:] + shape[:-1]


def _transposed(bits: torch.Tensor) -> torch.Tensor:
    """``bits`` ``[..., n]`` as TE's transpose ``[n, ...]`` (contiguous)."""
    return bits.reshape(-1, bits.shape[-1]).t().contiguous().reshape(_transpose_shape(bits.shape))


def _tensor_classes():
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor
    from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import (
        Float8TensorStorage,
    )

    return Float8Tensor, Float8TensorStorage


def _is_current_scaling(quantizer) -> bool:
    return type(quantizer).__name__ == "Float8CurrentScalingQuantizer"


def _check_supported(quantizer) -> None:
    name = type(quantizer).__name__
    if name not in ("Float8Quantizer", "Float8CurrentScalingQuantizer", "Float8BlockQuantizer"):
        raise NotImplementedError(
            f"the CPU backend of transformer_engine_torch casts per-tensor and block-scaled "
            f"FP8 (delayed, current and block scaling); {name} is not modelled: run it on a GPU"
        )


def _new_tensor(quantizer, shape, fake_dtype: torch.dtype, device, data, transpose, scale_inv):
    Float8Tensor, Float8TensorStorage = _tensor_classes()
    common = dict(
        data=data,
        fp8_scale_inv=scale_inv,
        fp8_dtype=quantizer.dtype,
        data_transpose=transpose,
        quantizer=quantizer,
    )
    if quantizer.internal:
        return Float8TensorStorage(fake_dtype=fake_dtype, **common)
    shape = list(shape)
    stride = torch.empty(shape, device="meta").stride()
    return Float8Tensor(shape=shape, stride=list(stride), dtype=fake_dtype, device=device, **common)


def create_empty_quantized_tensor(quantizer, shape, dtype, device=None, pin_memory=False):
    """An uninitialised FP8 tensor of ``shape`` with the buffers ``quantizer``'s usage asks for
    (``Float8Quantizer::create_tensor``); its fake dtype is ``dtype``."""
    _check_supported(quantizer)
    device = torch.device("cpu") if device is None else torch.device(device)
    device = torch.device("cpu") if device.type == "cuda" else device
    if blockwise.is_block_quantizer(quantizer):
        return blockwise.create_empty(quantizer, shape, dtype, device)
    data = torch.empty(list(shape), dtype=torch.uint8, device=device)
    transpose = (
        torch.empty(_transpose_shape(shape), dtype=torch.uint8, device=device)
        if quantizer.columnwise_usage
        else None
    )
    scale_inv = (
        torch.empty(1, dtype=torch.float32, device=device)
        if _is_current_scaling(quantizer)
        else torch.reciprocal(quantizer.scale)
    )
    return _new_tensor(
        quantizer,
        shape,
        dtype,
        device,
        data if quantizer.rowwise_usage else None,
        transpose,
        scale_inv,
    )


def _cast_bits(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: DType) -> torch.Tensor:
    """``x * scale`` rounded to FP8 with saturation, as ``uint8`` bits."""
    limit = FP8_MAX[DType(int(fp8_dtype))]
    scaled = (x.float() * scale.float()).clamp(-limit, limit)
    return scaled.to(TORCH_DTYPE[DType(int(fp8_dtype))]).view(torch.uint8)


def _cast_scale(quantizer, x: torch.Tensor) -> torch.Tensor:
    """The scale ``x`` is cast with; for delayed scaling also records ``max |x|`` in the
    quantizer's amax slot (running maximum)."""
    amax = x.detach().abs().max().float() if x.numel() else torch.zeros((), dtype=torch.float32)
    if not _is_current_scaling(quantizer):
        quantizer.amax.copy_(torch.maximum(quantizer.amax, amax.to(quantizer.amax.device)))
        return quantizer.scale.reshape(1)
    amax = amax.reshape(1).clone()
    if quantizer.with_amax_reduction:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=quantizer.amax_reduction_group)
    limit = FP8_MAX[DType(int(quantizer.dtype))]
    amax = amax.clamp(min=quantizer.amax_epsilon)
    usable = torch.isfinite(amax) & (amax > 0)
    scale = torch.where(usable, limit / amax, torch.ones_like(amax))
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, _FP32_MAX), scale)
    if quantizer.force_pow_2_scales:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def quantize(tensor: torch.Tensor, quantizer, output=None, noop_flag=None):
    """Cast ``tensor`` with ``quantizer`` into ``output`` (updated in place, its buffers as they
    are) or into a new FP8 tensor (``tex.quantize``). A ``noop_flag`` of 1 skips the cast (TE's
    CUDA-graph-safe "weights unchanged")."""
    _check_supported(quantizer)
    if noop_flag is not None and bool(noop_flag.reshape(-1)[0].item()):
        return output
    if output is None:
        output = create_empty_quantized_tensor(
            quantizer, tensor.shape, tensor.dtype, device=tensor.device
        )
    if tensor.numel() == 0:
        return output
    if blockwise.is_block_quantizer(quantizer):
        return blockwise.quantize_into(tensor, quantizer, output)
    scale = _cast_scale(quantizer, tensor)
    bits = _cast_bits(tensor, scale, quantizer.dtype)
    if output._data is not None:
        output._data.copy_(bits.reshape(output._data.shape))
    if output._transpose is not None:
        output._transpose.copy_(_transposed(bits))
        output._transpose_invalid = False
    output._scale_inv.copy_(torch.reciprocal(scale).reshape(output._scale_inv.shape))
    return output


def values(fp8, *, columnwise: bool = False) -> torch.Tensor:
    """An FP8 tensor's values in fp32, read from its row-wise bits (shape as the tensor) or its
    column-wise bits (``[last] + rest``); raises if that buffer is absent, as a kernel would
    fail to find it."""
    bits = fp8._transpose if columnwise else fp8._data
    if bits is None:
        kind = "column-wise (_transpose)" if columnwise else "row-wise (_data)"
        raise RuntimeError(f"the FP8 tensor has no {kind} data for this use")
    fp8_type = TORCH_DTYPE[DType(int(fp8._fp8_dtype))]
    return bits.view(fp8_type).float() * fp8._scale_inv.float()


def dequantize(tensor, otype) -> torch.Tensor:
    """``tex.dequantize``: the row-wise values in ``otype``."""
    return values(tensor).to(TORCH_DTYPE[DType(int(otype))])


def fp8_transpose(data: torch.Tensor, otype, out: torch.Tensor | None = None) -> torch.Tensor:
    """``tex.fp8_transpose``: FP8 bits ``[..., n]`` -> ``[n, ...]`` (into ``out`` if given)."""
    transposed = _transposed(data)
    if out is None:
        return transposed
    out.copy_(transposed.reshape(out.shape))
    return out


def bgrad_quantize(tensor: torch.Tensor, quantizer):
    """``tex.bgrad_quantize``: ``(bias gradient [n], tensor cast)`` for ``tensor`` ``[..., n]``."""
    grad_bias = tensor.reshape(-1, tensor.shape[-1]).float().sum(0).to(tensor.dtype)
    return grad_bias, quantize(tensor, quantizer)


def compute_amax(tensor: torch.Tensor, amax: torch.Tensor) -> None:
    """``tex.compute_amax``: ``max |tensor|`` into ``amax``."""
    amax.copy_(tensor.detach().abs().max().float().reshape(amax.shape))


def fused_amax_and_scale_update_after_reduction(
    amax_reduction_buffer: torch.Tensor,
    amax_histories: list[torch.Tensor],
    scales: list[torch.Tensor],
    amax_compute_algo: str,
    fp8_dtype,
    margin: float,
) -> None:
    """Delayed scaling's update at the end of an autocast (module docstring).

    Args:
        amax_reduction_buffer: ``[sum n_i]``, every history's row 0, reduced over the FP8 group.
        amax_histories: ``[length, n_i]`` each, updated in place.
        scales: ``[n_i]`` each, updated in place.
    """
    limit = FP8_MAX[DType(int(fp8_dtype))]
    reduced = amax_reduction_buffer.split([history.shape[1] for history in amax_histories])
    for history, scale, amax_now in zip(amax_histories, scales, reduced, strict=True):
        history[0].copy_(amax_now)
        amax = history.max(dim=0).values if amax_compute_algo == "max" else history[0].clone()
        history.copy_(torch.roll(history, -1, dims=0))
        history[0].zero_()
        new_scale = (limit / amax) / (2**margin)
        new_scale = torch.where((amax > 0) & torch.isfinite(amax), new_scale, scale)
        new_scale = torch.where(
            torch.isinf(new_scale), torch.full_like(new_scale, _FP32_MAX), new_scale
        )
        scale.copy_(new_scale)
