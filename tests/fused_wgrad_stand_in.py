"""A CPU stand-in for Apex's ``fused_weight_gradient_mlp_cuda``, bound where Megatron-Core
looks it up, so gradient-accumulation fusion runs on the CPU.

Megatron-Core imports the extension once, in ``megatron.core.tensor_parallel.layers``
(``_grad_accum_fusion_available``), its ``ColumnParallelLinear`` refuses
``gradient_accumulation_fusion=True`` without it, and every fused weight-gradient call (its
own linears', Domino's) reads ``layers.fused_weight_gradient_mlp_cuda`` when it runs.
:func:`installed` binds this module there for the duration of a ``with`` block, restoring
what was there on exit.

The contract kept (Apex's ``csrc/megatron/fused_weight_gradient_dense.cpp``, as Megatron-Core
0.19's ``LinearWithGradAccumulationAndAsyncCommunication.backward`` calls it):

* ``wgrad_gemm_accum_fp32(input, d_output, d_weight)``: ``d_weight += d_output^T @ input``,
  ``input [tokens, in]`` and ``d_output [tokens, out]`` in the activation dtype (bf16, fp16 or
  fp32), ``d_weight [out, in]`` fp32: a GEMM in the input dtype accumulating in fp32. On the
  CPU the operands are upcast and one fp32 ``addmm_`` runs: a product of two bf16 numbers is
  exact in fp32, so this is fp32 accumulation of the bf16 products (only the summation order
  differs from a tensor-core GEMM).
* ``wgrad_gemm_accum_fp16(input, d_output, d_weight)``: the same into a ``d_weight`` of the
  input's own dtype (bf16/fp16), as one ``addmm_`` in that dtype.

Each call is checked against that contract (dtypes, shapes, 2-D contiguous operands) and
recorded in :data:`CALLS`, so a test can tell which weight-gradient path ran: the fused one
with bf16 operands, not an fp32 ``addmm_`` of upcast copies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator

import torch
from megatron.core.tensor_parallel import layers as megatron_layers


@dataclasses.dataclass(frozen=True)
class Call:
    """One fused weight-gradient call."""

    kernel: str
    """``"fp32"`` or ``"fp16"`` (which of the two entry points)."""
    input_dtype: torch.dtype
    grad_dtype: torch.dtype
    main_grad_dtype: torch.dtype
    main_grad_ptr: int
    """``main_grad.data_ptr()``: which weight's gradient buffer it accumulated into."""
    tokens: int
    out_features: int
    """``d_output``'s columns: the weight's rows that ``d_weight`` holds (all, or a piece's)."""


#: Every call made while installed, in order.
CALLS: list[Call] = []


def _check_and_record(kernel: str, input, d_output, d_weight) -> None:
    if input.dtype != d_output.dtype:
        raise TypeError(f"input {input.dtype} and d_output {d_output.dtype} differ")
    if input.dim() != 2 or d_output.dim() != 2 or d_weight.dim() != 2:
        raise ValueError("the fused weight-gradient GEMM takes 2-D operands")
    if not (input.is_contiguous() and d_output.is_contiguous()):
        raise ValueError("the fused weight-gradient GEMM takes contiguous operands")
    if input.shape[0] != d_output.shape[0] or d_weight.shape != (
        d_output.shape[1],
        input.shape[1],
    ):
        raise ValueError(
            f"shapes: input {tuple(input.shape)}, d_output {tuple(d_output.shape)}, "
            f"d_weight {tuple(d_weight.shape)}"
        )
    CALLS.append(
        Call(
            kernel,
            input.dtype,
            d_output.dtype,
            d_weight.dtype,
            d_weight.data_ptr(),
            input.shape[0],
            d_output.shape[1],
        )
    )


def wgrad_gemm_accum_fp32(input, d_output, d_weight) -> None:
    """``d_weight (fp32) += d_output^T @ input``, accumulated in fp32."""
    if d_weight.dtype != torch.float32:
        raise TypeError(f"wgrad_gemm_accum_fp32 accumulates into fp32, not {d_weight.dtype}")
    _check_and_record("fp32", input, d_output, d_weight)
    d_weight.addmm_(d_output.t().float(), input.float())


def wgrad_gemm_accum_fp16(input, d_output, d_weight) -> None:
    """``d_weight (input's dtype) += d_output^T @ input``."""
    if d_weight.dtype != input.dtype or d_weight.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(
            f"wgrad_gemm_accum_fp16 accumulates fp16/bf16 into the same dtype; got input "
            f"{input.dtype}, d_weight {d_weight.dtype}"
        )
    _check_and_record("fp16", input, d_output, d_weight)
    d_weight.addmm_(d_output.t(), input)


_MISSING = object()


@contextlib.contextmanager
def installed() -> Iterator[list[Call]]:
    """Bind this stand-in as Megatron-Core's ``fused_weight_gradient_mlp_cuda``; yield
    :data:`CALLS` (cleared on entry)."""
    original = getattr(megatron_layers, "fused_weight_gradient_mlp_cuda", _MISSING)
    available = megatron_layers._grad_accum_fusion_available
    megatron_layers.fused_weight_gradient_mlp_cuda = sys.modules[__name__]
    megatron_layers._grad_accum_fusion_available = True
    CALLS.clear()
    try:
        yield CALLS
    finally:
        megatron_layers._grad_accum_fusion_available = available
        if original is _MISSING:
            del megatron_layers.fused_weight_gradient_mlp_cuda
        else:
            megatron_layers.fused_weight_gradient_mlp_cuda = original
