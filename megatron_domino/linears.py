"""Domino's versions of the ``forward`` of Megatron-Core's tensor-parallel linears.

They are bound per module instance by :mod:`megatron_domino.integration` (the class is left
untouched, so other models in the process keep stock behaviour) and act only while the
Domino schedule runs an op for a chunk; otherwise they call the stock ``forward``.

* :func:`row_parallel_forward` (attention ``linear_proj``, MLP ``linear_fc2``): during a core
  op it only captures its input, so that the schedule can run the GEMM in a later op, after
  another chunk's work has been issued. During the projection op it runs the GEMM with
  Megatron-Core's own ``_forward_impl``, split into ``k`` pieces along the output dimension
  ``h``, and launches each piece's all-reduce instead of Megatron's blocking
  ``reduce_from_tensor_model_parallel_region``.
  A Transformer Engine row-parallel linear takes the same path, its GEMM run by TE with its
  collective switched off (:func:`~megatron_domino.te_linears.te_row_partial`).
* :func:`column_parallel_forward` (``linear_qkv``, ``linear_fc1``): with backward overlap on,
  uses :func:`~megatron_domino.backward_overlap.column_linear_async_dgrad`, whose input
  gradient all-reduce is waited by the identity the schedule placed on the linear's input.

Chunk shapes are written for the batch split, ``[s, b/p, h]``; under the sequence split
read ``[s/p, b, h]``.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from megatron_domino.backward_overlap import column_linear_async_dgrad
from megatron_domino.collectives import PendingReduce
from megatron_domino.recorder import time_backward
from megatron_domino.sequence_parallel import keeping_input_shards
from megatron_domino.state import DominoRuntime
from megatron_domino.te_linears import is_te_linear, te_row_partial


def row_parallel_forward(module: torch.nn.Module, input_: torch.Tensor, *, runtime: DominoRuntime):
    """Capture (core op) or run-and-launch (projection op) a row-parallel linear.

    ``module`` is Megatron-Core's ``RowParallelLinear`` or a Transformer Engine row-parallel
    linear (see :mod:`megatron_domino.te_linears`; one piece only).

    Args:
        input_: ``[s, b/p, n/tp]``, this rank's slice of the attention context or of the
            MLP activation.
    Returns:
        ``(None, None)`` when capturing; else ``(PendingReduce, bias-or-None)``, the output
        ``[s, b/p, h]`` being available only through ``PendingReduce.wait``.
    """
    step = runtime.step
    if step is None or step.active is None:
        return type(module).forward(module, input_)
    chunk = step.active
    if step.deferred_module is module:
        chunk.deferred_input = input_
        return None, None
    if step.deferred_module is not None:
        raise RuntimeError(
            f"Domino: an unexpected {type(module).__name__} ran inside the "
            f"{step.sublayer} core op; this module structure is unsupported."
        )
    scatter = runtime.sequence_parallel
    label = step.label("rs" if scatter else "ar", runtime.recorder)
    te = is_te_linear(module)
    pending = PendingReduce(
        runtime.tp_group,
        label,
        bias=None if te or module.skip_bias_add else module.bias,
        scatter=scatter,
    )
    k = runtime.config.column_chunks
    returned_bias = None if te or not module.skip_bias_add else module.bias
    gemm = f"{step.sublayer}_projection_gemm"
    for piece in range(k):
        with runtime.recorder.region(gemm, label.layer, label.chunk, "fwd", piece):
            if te:
                partial, returned_bias = te_row_partial(module, input_)
            else:
                partial = _local_row_partial(module, input_, piece, k)
        time_backward(partial, runtime.recorder, gemm, label.layer, label.chunk, piece)
        pending.launch(partial)
    return pending, returned_bias


def _local_row_partial(
    module: RowParallelLinear, input_: torch.Tensor, piece: int, pieces: int
) -> torch.Tensor:
    """Piece ``piece`` of ``pieces`` of this rank's partial sum ``[s, b/p, h/pieces]``.

    Megatron-Core's own GEMM path (frozen weights, main_grad accumulation), called by keyword:
    the positional order changed between releases. A weight slice has no main_grad, so pieces
    accumulate through autograd instead.
    """
    weight = module.weight.chunk(pieces, dim=0)[piece] if pieces > 1 else module.weight
    return module._forward_impl(
        input=input_,
        weight=weight,
        bias=None,
        gradient_accumulation_fusion=module.gradient_accumulation_fusion and pieces == 1,
        allreduce_dgrad=False,
        sequence_parallel=False,
        tp_group=None,
        grad_output_buffer=None,
    )


def column_parallel_forward(
    module: ColumnParallelLinear,
    input_: torch.Tensor,
    weight: torch.Tensor | None = None,
    runtime_gather_output: bool | None = None,
    *,
    runtime: DominoRuntime,
):
    """Column-parallel GEMM whose input-gradient collective outlives its backward.

    Without sequence parallelism the GEMM's backward launches the dX all-reduce (waited by the
    identity the schedule placed on ``input_``). With it, ``input_`` was already gathered by
    the schedule, whose gather nodes also reduce-scatter dX, so this is Megatron's own GEMM
    path, keeping only this rank's shard of ``input_`` for backward, as stock sequence
    parallelism does
    (:func:`~megatron_domino.sequence_parallel.keeping_input_shards`).

    Args:
        input_: ``[s, b/p, h]``, the norm output, replicated (or gathered) on every TP rank.
    Returns:
        ``(output [s, b/p, n/tp], bias-or-None)`` as Megatron-Core's ``forward``.
    """
    step = runtime.step
    chunk = None if step is None else step.active
    if chunk is None or not (runtime.sequence_parallel or chunk.dgrad_slot is not None):
        return ColumnParallelLinear.forward(module, input_, weight, runtime_gather_output)
    if input_ is not chunk.linear_input or weight is not None or runtime_gather_output:
        raise RuntimeError(
            "Domino: a column-parallel linear received something other than the norm output "
            "the schedule prepared for it; this Megatron-Core module structure is unsupported."
        )
    bias = None if module.skip_bias_add else module.bias
    if runtime.sequence_parallel:
        with keeping_input_shards(chunk.input_regather, input_):
            output = module._forward_impl(
                input=input_,
                weight=module.weight,
                bias=bias,
                gradient_accumulation_fusion=module.gradient_accumulation_fusion,
                allreduce_dgrad=False,
                sequence_parallel=False,
                tp_group=None,
                grad_output_buffer=None,
            )
        time_backward(
            output, runtime.recorder, f"{step.sublayer}_column_gemm", step.layer, chunk.index
        )
    else:
        slot, chunk.dgrad_slot = chunk.dgrad_slot, None
        accumulate = module.gradient_accumulation_fusion and hasattr(module.weight, "main_grad")
        output = column_linear_async_dgrad(input_, module.weight, bias, slot, accumulate)
    return output, module.bias if module.skip_bias_add else None
