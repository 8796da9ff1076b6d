"""``tex.generic_gemm`` on the CPU: TE's GEMM call, its layout and epilogues, as torch ops.

TE's Python calls cuBLAS through one function (``pytorch/csrc/extensions/gemm.cpp``,
``gemm(A, transa, B, transb, D, quantizer, out_dtype, bias, bias_type, gelu, gelu_in, grad,
workspace, workspace_size, accumulate, use_split_accumulator, ...)``). In row-major terms it
computes ``D = alpha * op(B) @ op(A) (+ beta * D)``, where ``op`` transposes when its flag is
set, after flattening each operand to 2-D ``[prod(leading), last]``: the forward ``"TN"``
is ``X @ W^T``, the input gradient ``"NN"`` ``dY @ W``, the weight gradient ``"NT"``
``dY^T @ X``. The output keeps ``B``'s leading dimensions unless ``transb``
(``getGemmOutputShape``).

FP8 operands are read as an H100 reads them (sm_90 multiplies "TN" FP8 operands only):
``A`` from its row-wise bits when ``transa``, else from its column-wise transpose; ``B`` from
its row-wise bits unless ``transb``. An operand lacking that buffer fails, as the kernel
would. The product is formed in fp32 from the operands' values (FP8 bits times
``scale_inv``), then:

* ``bias`` (forward): added; with ``grad``: the bias gradient is ``B``'s column sums;
* ``accumulate``: added to the existing ``D`` (``beta`` 1 unless given), as the fused
  weight-gradient accumulation into ``main_grad`` does;
* ``quantizer``: the result is cast to FP8 with it, into ``D`` if given;
* otherwise rounded once to ``out_dtype`` (``A``'s dtype by default).

Block-scaled operands (``--fp8-recipe blockwise``) are read the same way, each from the buffer
Hopper reads (:mod:`te_cpu.blockwise`). Not modelled: the GELU epilogue, userbuffers overlap,
MXFP8/NVFP4 operands (they raise). cuBLAS sums in another order: compare Domino with stock on this backend, never
with a GPU's numbers.
"""

from __future__ import annotations

import torch

from te_cpu import blockwise, fp8
from te_cpu.enums import TORCH_DTYPE, DType

__all__ = ["generic_gemm"]


def _is_fp8(operand) -> bool:
    return hasattr(operand, "_fp8_dtype") and hasattr(operand, "_transpose")


def _logical_shape(operand) -> list[int]:
    if blockwise.is_blockwise(operand):
        return list(operand.size())
    if not _is_fp8(operand):
        return list(operand.shape)
    if operand._data is not None:
        return list(operand._data.shape)
    transposed = list(operand._transpose.shape)
    return transposed[1:] + transposed[:1]


def _operand(operand, transposed_use: bool) -> torch.Tensor:
    """The operand as a 2-D fp32 matrix ``[prod(leading), last]`` of its logical shape.

    ``transposed_use``: the GEMM reads the operand transposed from how it would read row-wise
    bits in "TN" form, which for FP8 on sm_90 means its column-wise bits.
    """
    if blockwise.is_blockwise(operand):
        logical = blockwise.values(operand, columnwise=transposed_use)
        return logical.reshape(-1, logical.shape[-1])
    if not _is_fp8(operand):
        return operand.reshape(-1, operand.shape[-1]).float()
    if operand.__class__.__name__.startswith(("MXFP8", "NVFP4")):
        raise NotImplementedError(f"the CPU backend's GEMM does not read {type(operand).__name__}")
    if not transposed_use:
        bits = fp8.values(operand)
        return bits.reshape(-1, bits.shape[-1])
    columnwise = fp8.values(operand, columnwise=True)
    return columnwise.reshape(columnwise.shape[0], -1).t()


def generic_gemm(
    A,
    transa: bool,
    B,
    transb: bool,
    D,
    quantizer,
    out_dtype,
    bias,
    bias_type,
    gelu: bool,
    gelu_in,
    grad: bool,
    workspace,
    workspace_size,
    accumulate: bool,
    use_split_accumulator: bool,
    comm_overlap=None,
    comm_type=None,
    extra_output=None,
    bulk_overlap: bool = False,
    alpha: float = 1.0,
    beta: float | None = None,
):
    """``[D, bias gradient or None, pre-GELU output or None, extra output]`` (module
    docstring). The unused arguments are TE's signature (workspace, split accumulator)."""
    if gelu:
        raise NotImplementedError("the CPU backend's GEMM has no GELU epilogue")
    if comm_overlap is not None:
        raise NotImplementedError("userbuffers GEMM overlap needs a GPU")
    a = _operand(A, transposed_use=not transa)
    b = _operand(B, transposed_use=transb)
    op_a = a.t() if transa else a
    op_b = b.t() if transb else b
    result = alpha * (op_b @ op_a)
    b_shape = _logical_shape(B)
    out_shape = [b.shape[1]] if transb else b_shape[:-1]
    out_shape.append(op_a.shape[1])

    bias_grad = None
    if bias is not None and grad:
        bias_grad = b.sum(0).to(bias.dtype)
    elif bias is not None:
        result = result + bias.float()
    if accumulate and not _is_fp8(D):
        # In place, as cuBLAS writes D (a sum into main_grad allocates nothing).
        if beta is not None and beta != 1.0:
            D.mul_(beta)
        D.add_(result.reshape(D.shape))
        return [D, bias_grad, None, extra_output]
    if accumulate:
        result = result + (1.0 if beta is None else beta) * fp8.values(D).reshape(result.shape)
    result = result.reshape(out_shape)

    dtype = (
        TORCH_DTYPE[DType(int(out_dtype))]
        if out_dtype is not None
        else (D.dtype if D is not None else A.dtype)
    )
    if quantizer is not None:
        if D is None:
            D = fp8.create_empty_quantized_tensor(quantizer, out_shape, dtype, result.device)
        return [fp8.quantize(result, quantizer, output=D), bias_grad, None, extra_output]
    if D is None:
        D = result.to(dtype)
    else:
        D.copy_(result.reshape(D.shape))
    return [D, bias_grad, None, extra_output]
