"""One column piece of a row-parallel linear whose ``dW`` goes into its rows of ``main_grad``.

With ``--domino-column-chunks k > 1`` the row-parallel GEMM of a chunk is split along its
output dimension ``h`` into ``k`` pieces, so each piece's collective can start early
(:func:`megatron_domino.engine.linears.row_projection`). Piece ``r`` multiplies by the weight rows
``W_r = W.chunk(k)[r]`` (``[h/k, n/tp]``). Run through Megatron-Core's linear on the slice
``W_r``, the weight gradient would lose gradient-accumulation fusion (a slice has no
``main_grad``) and autograd would zero-pad each piece's ``dW_r`` to a full ``[h, n/tp]``
gradient in the slice's backward: ``k`` weight-sized gradients per chunk, summed into
``weight.grad`` and only then added to ``main_grad`` by DDP's hook.

:class:`_ColumnPieceLinear` takes the whole weight instead and accumulates ``dW_r`` straight
into the piece's rows of ``main_grad`` (a contiguous ``[h/k, n/tp]`` view) with Megatron-Core's
fused weight-gradient GEMM, the same call and dtype contract as stock
(:func:`~megatron_domino.engine.backward_overlap.accumulate_weight_gradient`); the ``k`` pieces'
rows tile ``main_grad``, so it ends up holding what stock's one GEMM accumulates. Like
Megatron-Core's linear it then returns the shared placeholder gradient of the whole weight
(:func:`~megatron_domino.engine.backward_overlap.placeholder_gradient`), of which the schedule keeps
one per weight per backward (:mod:`megatron_domino.engine.placeholder_grads`).
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import custom_bwd, custom_fwd
from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

from megatron_domino.engine.backward_overlap import accumulate_weight_gradient, placeholder_gradient

__all__ = ["column_piece_into_main_grad"]


class _ColumnPieceLinear(torch.autograd.Function):
    """``Y_r = X @ W_r^T``, ``dX = dY_r @ W_r``, ``main_grad[rows of r] += dY_r^T @ X``.

    Shapes: ``X`` ``[s, b/p, n/tp]``, ``W`` ``[h, n/tp]``, ``Y_r`` ``[s, b/p, h/k]``. Autocast
    decorated as Megatron-Core's own linear (``custom_fwd``/``custom_bwd``: the backward runs
    in the forward's autocast state).
    """

    @staticmethod
    @custom_fwd
    def forward(ctx, input_, weight, piece: int, pieces: int):
        ctx.save_for_backward(input_, weight)
        ctx.piece, ctx.pieces = piece, pieces
        return torch.matmul(input_, weight.chunk(pieces, dim=0)[piece].t())

    @staticmethod
    @custom_bwd
    def backward(ctx, grad_output):
        input_, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight.chunk(ctx.pieces, dim=0)[ctx.piece])
        grad_2d, input_2d = prepare_input_tensors_for_wgrad_compute(grad_output, input_)
        rows = weight.main_grad.chunk(ctx.pieces, dim=0)[ctx.piece]
        accumulate_weight_gradient(rows, input_2d, grad_2d)
        grad_weight = None
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
            zero = getattr(weight, "zero_out_wgrad", False)
            grad_weight = placeholder_gradient(
                weight.main_grad.shape, input_2d.dtype, input_2d.device, zero=zero
            )
        return grad_input, grad_weight, None, None


def column_piece_into_main_grad(
    input_: torch.Tensor, weight: torch.Tensor, piece: int, pieces: int
) -> torch.Tensor:
    """Piece ``piece`` of ``pieces`` of ``input_ @ weight^T``: ``[s, b/p, h/pieces]`` from
    ``input_`` ``[s, b/p, n/tp]`` and ``weight`` ``[h, n/tp]`` (which has ``main_grad``), its
    weight gradient accumulated into the piece's rows of ``weight.main_grad``."""
    return _ColumnPieceLinear.apply(input_, weight, piece, pieces)
