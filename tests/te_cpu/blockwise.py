"""FP8 block scaling (``--fp8-recipe blockwise``, TE's ``Float8BlockQuantizer``) on the CPU.

What TE's extension does for Hopper's block-scaled FP8 (``pytorch/csrc/quantizer.cpp``
``Float8BlockQuantizer``, ``common/recipe/recipe_common.cuh``), as torch ops over the tensor
flattened to ``[M, K]`` (every leading dimension into ``M``):

* ``block_scaling_dim == 1`` (activations and gradients): one scale per ``1 x 128`` tile along
  ``K`` for the row-wise bits ``[M, K]``; the column-wise bits are the transpose ``[K, M]``
  cast with its own ``1 x 128`` tiles along ``M`` (``128 x 1`` tiles of the tensor). Scales
  are stored transposed and padded, as the GEMM reads them: row-wise
  ``[ceil(K/128), roundup(M, 4)]``, column-wise ``[ceil(M/128), roundup(K, 4)]``;
* ``block_scaling_dim == 2`` (weights): one scale per ``128 x 128`` block, shared by the
  row-wise bits and their transpose; scales ``[ceil(M/128), roundup(ceil(K/128), 4)]`` and
  their transpose (TE ``Float8BlockQuantizer.get_scale_shape``);
* each tile's scale is ``fp8_max / max(amax, epsilon)`` (1 where the amax is 0, inf or NaN;
  the input type's largest value where the division overflows), rounded down to a power of 2
  when the quantizer forces it; the cast rounds to nearest and saturates.

Values are read back with TE's own Python dequantisation (``Float8BlockwiseQTensorStorage``),
from the buffer a GEMM reads.
"""

from __future__ import annotations

import math

import torch

from te_cpu.enums import FP8_MAX, TORCH_DTYPE, DType

__all__ = ["create_empty", "is_block_quantizer", "is_blockwise", "quantize_into", "values"]

_BLOCK = 128


def is_block_quantizer(quantizer) -> bool:
    return type(quantizer).__name__ == "Float8BlockQuantizer"


def is_blockwise(tensor) -> bool:
    return hasattr(tensor, "_rowwise_scale_inv") and hasattr(tensor, "_is_2D_scaled")


def _classes():
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockwiseQTensor
    from transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage import (
        Float8BlockwiseQTensorStorage,
    )

    return Float8BlockwiseQTensor, Float8BlockwiseQTensorStorage


def create_empty(quantizer, shape, dtype: torch.dtype, device) -> object:
    """An uninitialised block-scaled FP8 tensor of ``shape`` with the buffers ``quantizer``'s
    usage asks for (``Float8BlockQuantizer::create_tensor``)."""
    shape = list(shape)

    def empty(size, kind):
        return torch.empty(list(size), dtype=kind, device=device)

    rowwise = quantizer.rowwise_usage
    columnwise = quantizer.columnwise_usage
    parts = dict(
        rowwise_data=empty(shape, torch.uint8) if rowwise else None,
        rowwise_scale_inv=(
            empty(quantizer.get_scale_shape(shape, False), torch.float32) if rowwise else None
        ),
        columnwise_data=(
            empty(quantizer.get_columnwise_shape(shape), torch.uint8) if columnwise else None
        ),
        columnwise_scale_inv=(
            empty(quantizer.get_scale_shape(shape, True), torch.float32) if columnwise else None
        ),
        fp8_dtype=quantizer.dtype,
        quantizer=quantizer,
        is_2D_scaled=quantizer.block_scaling_dim == 2,
    )
    tensor_class, storage_class = _classes()
    if quantizer.internal:
        return storage_class(fake_dtype=dtype, **parts)
    stride = torch.empty(shape, device="meta").stride()
    return tensor_class(shape=shape, stride=list(stride), dtype=dtype, device=device, **parts)


def _tile_scales(amax: torch.Tensor, quantizer, input_dtype: torch.dtype) -> torch.Tensor:
    limit = FP8_MAX[DType(int(quantizer.dtype))]
    amax = amax.clamp(min=quantizer.amax_epsilon)
    usable = torch.isfinite(amax) & (amax > 0)
    scale = torch.where(usable, limit / amax, torch.ones_like(amax))
    overflow = torch.finfo(input_dtype if input_dtype.is_floating_point else torch.float32).max
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, overflow), scale)
    if quantizer.force_pow_2_scales:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return scale


def _cast(x: torch.Tensor, scale: torch.Tensor, quantizer) -> torch.Tensor:
    limit = FP8_MAX[DType(int(quantizer.dtype))]
    scaled = (x * scale).clamp(-limit, limit)
    return scaled.to(TORCH_DTYPE[DType(int(quantizer.dtype))]).view(torch.uint8)


def _padded(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]))


def _one_d(x: torch.Tensor, quantizer, input_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` in ``1 x 128`` tiles: bits ``[M, K]``, scale_inv ``[ceil(K/128), M]``."""
    m, k = x.shape
    blocks = math.ceil(k / _BLOCK)
    tiles = _padded(x, m, blocks * _BLOCK).reshape(m, blocks, _BLOCK)
    scale = _tile_scales(tiles.abs().amax(dim=-1), quantizer, input_dtype)  # [M, Kb]
    bits = _cast(tiles, scale[..., None], quantizer).reshape(m, blocks * _BLOCK)[:, :k]
    return bits, torch.reciprocal(scale).t()


def _two_d(x: torch.Tensor, quantizer, input_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` in ``128 x 128`` blocks: bits ``[M, K]``, scale_inv ``[Mb, Kb]``."""
    m, k = x.shape
    mb, kb = math.ceil(m / _BLOCK), math.ceil(k / _BLOCK)
    blocks = _padded(x, mb * _BLOCK, kb * _BLOCK).reshape(mb, _BLOCK, kb, _BLOCK)
    scale = _tile_scales(blocks.abs().amax(dim=(1, 3)), quantizer, input_dtype)
    bits = _cast(blocks, scale[:, None, :, None], quantizer)
    return bits.reshape(mb * _BLOCK, kb * _BLOCK)[:m, :k], torch.reciprocal(scale)


def _store(target: torch.Tensor, source: torch.Tensor) -> None:
    """``source`` into the top-left corner of the padded ``target``; the padding zeroed."""
    target.zero_()
    target[: source.shape[0], : source.shape[1]].copy_(source)


def quantize_into(tensor: torch.Tensor, quantizer, output) -> object:
    """Cast ``tensor`` into the block-scaled ``output`` (module docstring)."""
    x = tensor.detach().reshape(-1, tensor.shape[-1]).float()
    if quantizer.block_scaling_dim == 2:
        bits, scale_inv = _two_d(x, quantizer, tensor.dtype)
        rowwise = (bits, scale_inv)
        columnwise = (bits.t().contiguous(), scale_inv.t())
    else:
        rowwise = _one_d(x, quantizer, tensor.dtype)
        columnwise = _one_d(x.t().contiguous(), quantizer, tensor.dtype)
    if output._rowwise_data is not None:
        output._rowwise_data.copy_(rowwise[0].reshape(output._rowwise_data.shape))
        _store(output._rowwise_scale_inv, rowwise[1])
    if output._columnwise_data is not None:
        output._columnwise_data.copy_(columnwise[0].reshape(output._columnwise_data.shape))
        _store(output._columnwise_scale_inv, columnwise[1])
    return output


def values(operand, *, columnwise: bool) -> torch.Tensor:
    """The block-scaled ``operand``'s values in fp32 (its logical shape), read from its
    row-wise or its column-wise buffer by TE's own dequantisation; raises if that buffer is
    absent, as the GEMM would fail to find it."""
    data = operand._columnwise_data if columnwise else operand._rowwise_data
    if data is None:
        kind = "column-wise" if columnwise else "row-wise"
        raise RuntimeError(f"the block-scaled FP8 tensor has no {kind} data for this use")
    _, storage_class = _classes()
    scale_inv = operand._columnwise_scale_inv if columnwise else operand._rowwise_scale_inv
    buffers = (None, None, data, scale_inv) if columnwise else (data, scale_inv, None, None)
    one_buffer = storage_class(
        *buffers, operand._fp8_dtype, operand._quantizer, operand._is_2D_scaled,
        fake_dtype=torch.float32,
    )  # fmt: skip
    return one_buffer.dequantize(dtype=torch.float32)
