"""Backward overlap: a column-parallel linear whose input-gradient all-reduce crosses chunks.

Megatron-Core's column-parallel linear (QKV, fc1) launches the all-reduce of its input
gradient ``dX = dY @ W`` (``[s, b/p, h]``), computes ``dW`` while it flies, then *waits before
returning*, so the collective can hide behind that one GEMM only. Here the linear's backward
launches the all-reduce, computes ``dW``, and returns ``dX`` still in flight; an identity placed
on the linear's input (the norm output) waits for it in its backward. Between the two, the
autograd engine runs other chunks' backward work, because the schedule created that work
between the identity and the linear in forward (the engine runs ready nodes latest-created
first). The pair shares a :class:`~megatron_domino.communication.collectives.DgradAllReduce`.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import layers as megatron_layers
from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

from megatron_domino.communication.collectives import DgradAllReduce


class _WaitForDgradReduce(torch.autograd.Function):
    """Forward: identity on the linear's input; backward: wait for the slot's all-reduce."""

    @staticmethod
    def forward(ctx, linear_input: torch.Tensor, slot: DgradAllReduce):
        ctx.slot = slot
        return linear_input

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return ctx.slot.wait(grad_output), None


def wait_for_dgrad_reduce(linear_input: torch.Tensor, slot: DgradAllReduce) -> torch.Tensor:
    """Place the backward wait of ``slot`` on ``linear_input`` (``[s, b/p, h]``)."""
    return _WaitForDgradReduce.apply(linear_input, slot)


class _ColumnLinearAsyncDgrad(torch.autograd.Function):
    """``Y = X @ W^T (+ b)`` whose backward leaves the ``dX`` all-reduce in flight.

    Shapes: ``X`` ``[s, b/p, h]``, ``W`` ``[n/tp, h]`` (this rank's rows), ``Y`` ``[s, b/p, n/tp]``.
    With gradient-accumulation fusion (Megatron's ``main_grad``), ``dW`` is accumulated into
    ``W.main_grad`` by Megatron-Core's fused weight-gradient GEMM
    (:func:`accumulate_weight_gradient`) and a reused placeholder gradient is returned
    (:func:`placeholder_gradient`), as Megatron-Core's own linear does, so its DDP hooks know
    the gradient is already accumulated. Autocast-decorated with Megatron-Core's own
    ``custom_fwd``/``custom_bwd`` (``torch.amp``'s, ``device_type="cuda"``), as its linear is:
    the backward runs in the autocast state the forward ran in, wherever ``backward()`` is
    called from.
    """

    @staticmethod
    @megatron_layers.custom_fwd
    def forward(
        ctx, linear_input, weight, bias, slot: DgradAllReduce, accumulate_in_main_grad: bool
    ):
        # The weight itself, not a saved tensor: a saved tensor comes back from backward as a
        # new tensor object (always so under saved-tensor hooks, as sequence parallelism's
        # keeping of input shards installs), without the parameter's ``main_grad`` and
        # ``grad_added_to_main_grad``, which fused accumulation and DDP's hook read on it.
        ctx.save_for_backward(linear_input)
        ctx.weight = weight
        ctx.slot = slot
        ctx.has_bias = bias is not None
        ctx.accumulate_in_main_grad = accumulate_in_main_grad
        output = torch.matmul(linear_input, weight.t())
        return output + bias if bias is not None else output

    @staticmethod
    @megatron_layers.custom_bwd
    def backward(ctx, grad_output):
        (linear_input,), weight = ctx.saved_tensors, ctx.weight
        label = ctx.slot.label
        with label.recorder.region("dgrad_gemm", label.layer, label.chunk, "bwd"):
            grad_input = grad_output.matmul(weight)
        ctx.slot.launch(grad_input)
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            with label.recorder.region("wgrad_gemm", label.layer, label.chunk, "bwd"):
                grad_2d, input_2d = prepare_input_tensors_for_wgrad_compute(
                    grad_output, linear_input
                )
                grad_weight = weight_gradient(
                    weight, grad_2d, input_2d, ctx.accumulate_in_main_grad
                )
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(dim=0)
        return grad_input, grad_weight, grad_bias, None, None


def weight_gradient(weight, grad_2d, input_2d, accumulate_in_main_grad: bool):
    """``dW = dY^T @ X`` (``[n/tp, h]``), or its accumulation into ``weight.main_grad``.

    ``grad_2d`` ``[s*b/p, n/tp]`` and ``input_2d`` ``[s*b/p, h]`` are contiguous.
    """
    if not accumulate_in_main_grad:
        return grad_2d.t().matmul(input_2d)
    accumulate_weight_gradient(weight.main_grad, input_2d, grad_2d)
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    # Megatron-Core returns a placeholder gradient here so DDP's hooks run on the main thread.
    zero = getattr(weight, "zero_out_wgrad", False)
    return placeholder_gradient(weight.main_grad.shape, input_2d.dtype, input_2d.device, zero=zero)


def accumulate_weight_gradient(
    main_grad: torch.Tensor, input_2d: torch.Tensor, grad_2d: torch.Tensor
) -> None:
    """``main_grad += grad_2d^T @ input_2d`` through Megatron-Core's fused weight-gradient GEMM.

    The same call, with the same dtype contract, as Megatron-Core's own column-parallel linear
    (``LinearWithGradAccumulationAndAsyncCommunication.backward``): the GEMM reads the
    activation dtype (bf16/fp16) and accumulates in fp32 into an fp32 ``main_grad``
    (``wgrad_gemm_accum_fp32``), or into a bf16/fp16 ``main_grad`` (``wgrad_gemm_accum_fp16``).
    The kernels are Apex's ``fused_weight_gradient_mlp_cuda``, looked up where Megatron-Core
    binds them (``megatron.core.tensor_parallel.layers``) at each call.

    Args:
        main_grad: ``[n/tp, h]``, the weight's gradient buffer (Megatron DDP's).
        input_2d: ``[tokens, h]``, the linear's input.
        grad_2d: ``[tokens, n/tp]``, its output gradient.
    Raises:
        RuntimeError: the fused kernels are not installed (Megatron-Core's linear refuses
            ``gradient_accumulation_fusion`` then too), or ``main_grad`` has another dtype.
    """
    if not megatron_layers._grad_accum_fusion_available:
        raise RuntimeError(
            "gradient_accumulation_fusion is on but Megatron-Core found no "
            "fused_weight_gradient_mlp_cuda (Apex's CUDA extension); install Apex with its "
            "CUDA extensions or turn gradient accumulation fusion off "
            "(--no-gradient-accumulation-fusion)."
        )
    kernels = megatron_layers.fused_weight_gradient_mlp_cuda
    if main_grad.dtype == torch.float32:
        kernels.wgrad_gemm_accum_fp32(input_2d, grad_2d, main_grad)
    elif main_grad.dtype in (torch.float16, torch.bfloat16):
        kernels.wgrad_gemm_accum_fp16(input_2d, grad_2d, main_grad)
    else:
        raise RuntimeError(
            f"Unsupported gradient type {main_grad.dtype} for gradient accumulation fusion"
        )


#: Placeholder gradients by (shape, dtype, device), when Transformer Engine is absent.
_PLACEHOLDERS: dict[tuple, torch.Tensor] = {}


def placeholder_gradient(
    shape, dtype: torch.dtype, device: torch.device, *, zero: bool
) -> torch.Tensor:
    """The gradient a weight gets once its ``dW`` went into ``main_grad``: a reused buffer.

    Its values are never read (DDP's hook skips a weight with ``grad_added_to_main_grad``),
    except with ``zero_out_wgrad``, where it must be zeros. Megatron-Core's linear takes it
    from TE's ``get_dummy_wgrad`` (one buffer per shape and dtype) when TE is installed, and
    so does this; without TE it would allocate one per call, which a buffer per
    ``(shape, dtype, device)`` avoids.
    """
    if megatron_layers.HAVE_TE:
        return megatron_layers.get_dummy_wgrad(list(shape), dtype, zero=zero)
    key = (tuple(shape), dtype, torch.device(device))
    buffer = _PLACEHOLDERS.get(key)
    if buffer is None:
        buffer = _PLACEHOLDERS[key] = torch.empty(key[0], dtype=dtype, device=device)
    if zero:
        buffer.zero_()
    return buffer.detach()


def column_linear_async_dgrad(
    linear_input, weight, bias, slot: DgradAllReduce, accumulate_in_main_grad: bool
) -> torch.Tensor:
    """Apply the column-parallel GEMM whose backward launches ``slot``'s all-reduce."""
    return _ColumnLinearAsyncDgrad.apply(linear_input, weight, bias, slot, accumulate_in_main_grad)
