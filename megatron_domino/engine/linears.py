"""Megatron-Core's tensor-parallel linears under the schedule.

:mod:`megatron_domino.apply` binds these onto module instances (the class is left untouched,
so other models in the process keep stock behaviour; :mod:`megatron_domino.plan` says which
function goes where, for Megatron's own linears and Transformer Engine's). Outside a Domino op
every one of them runs the stock ``forward``.

* **Row-parallel** (attention ``linear_proj``, MLP ``linear_fc2``): the schedule wants the
  GEMM one op later than Megatron's ``SelfAttention``/``MLP`` forward calls it, so that another
  chunk's work is issued in between. So the bound forward, :func:`capture_row_input`, runs
  during the core op and only records what to compute (:class:`~megatron_domino.engine.row_output.DeferredRow`); the projection
  op then calls :func:`row_projection`, which runs the GEMM (split into ``k`` pieces along
  the output dimension ``h``, without any collective: :class:`~megatron_domino.engine.row_output.RowGemm`) and launches each
  piece's all-reduce, or under sequence parallelism its reduce-scatter, instead of Megatron's
  blocking ``reduce_from_tensor_model_parallel_region``. It returns a
  :class:`~megatron_domino.engine.row_output.PendingReduce`,
  which the next norm op waits for.
* **Column-parallel** (``linear_qkv``, ``linear_fc1``), :func:`column_parallel_forward`: with
  backward overlap, the GEMM whose backward leaves the input-gradient all-reduce (under
  sequence parallelism: reduce-scatter) in flight
  (:mod:`megatron_domino.engine.backward_overlap`); under sequence parallelism on the input the
  schedule gathered, keeping only this rank's shard of it for backward
  (:mod:`megatron_domino.communication.saved_shards`).

Chunk shapes are written for the batch split, ``[s, b/p, h]``; under the sequence split
read ``[s/p, b, h]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear

from megatron_domino.base.recorder import CollectiveLabel, time_backward
from megatron_domino.communication.collectives import SUBLAYER_LABELS
from megatron_domino.communication.saved_shards import keeping_input_shards
from megatron_domino.communication.te_quantizers import fp8_grad_output_quantizer
from megatron_domino.engine.backward_overlap import column_linear_async_dgrad
from megatron_domino.engine.placeholder_grads import one_placeholder_per_call
from megatron_domino.engine.row_output import (
    DeferredRow,
    PendingReduce,
    RowGemm,
    output_dtype_option,
)

if TYPE_CHECKING:
    from megatron_domino.engine.state import ChunkState, DominoRuntime

__all__ = ["capture_row_input", "column_parallel_forward", "row_projection"]


def capture_row_input(
    module: torch.nn.Module, input_: torch.Tensor, *, runtime: DominoRuntime, gemm: RowGemm
):
    """The bound ``forward`` of a row-parallel linear: during the core op that is expected to
    call it, record the call for the projection op and return ``(None, None)`` (Megatron's
    ``SelfAttention``/``MLP`` hand that on as their output, which the schedule ignores)."""
    step = runtime.step
    if step is None or step.active is None:
        return type(module).forward(module, input_)
    if step.deferred_module is not module:
        raise RuntimeError(
            f"Domino: an unexpected {type(module).__name__} ran inside the "
            f"{step.sublayer} core op; this module structure is unsupported."
        )
    step.active.deferred = DeferredRow(module, input_, gemm)
    return None, None


def row_projection(
    runtime: DominoRuntime, chunk: ChunkState, layer: int, sublayer: str
) -> tuple[PendingReduce, torch.Tensor | None]:
    """The projection op's GEMM of ``chunk``'s captured row-parallel call, its collectives
    launched: ``(PendingReduce, bias-or-None)``, the output ``[s, b/p, h]`` (``[s/tp, b/p, h]``
    under sequence parallelism) being available only through :meth:`PendingReduce.wait`."""
    deferred, chunk.deferred = chunk.deferred, None
    module, recorder = deferred.module, runtime.recorder
    scatter = runtime.sequence_parallel
    name = SUBLAYER_LABELS[sublayer].row_output(scatter)
    label = CollectiveLabel(name, layer, chunk.index, recorder)
    pending = PendingReduce(
        runtime.tp_group, label, bias=deferred.gemm.bias_after_reduce(module), scatter=scatter
    )
    k = runtime.config.column_chunks
    returned_bias = None
    gemm = f"{sublayer}_projection_gemm"
    for piece in range(k):
        with recorder.region(gemm, layer, chunk.index, "fwd", piece):
            partial, returned_bias = deferred.gemm.partial(module, deferred.input_, piece, k)
        one_placeholder_per_call(
            partial,
            module.weight,
            chunk=chunk.index,
            piece=piece,
            legs=runtime.step.legs is not None,
        )
        time_backward(partial, recorder, gemm, layer, chunk.index, piece)
        pending.launch(partial)
    if scatter:
        pending.grad_quantizer = fp8_grad_output_quantizer(module)
        pending.amax_group = runtime.amax_group
    return pending, returned_bias


def column_parallel_forward(
    module: ColumnParallelLinear,
    input_: torch.Tensor,
    weight: torch.Tensor | None = None,
    runtime_gather_output: bool | None = None,
    *,
    runtime: DominoRuntime,
):
    """Column-parallel GEMM whose input-gradient collective outlives its backward.

    The GEMM's backward launches the dX collective between its dgrad and dW GEMMs: without
    sequence parallelism the all-reduce (waited by the identity the schedule placed on
    ``input_``); with it, ``input_`` was gathered by the schedule and the collective is the
    reduce-scatter of dX on the same slot
    (:class:`~megatron_domino.communication.sequence_parallel.InputGradientScatter`, waited by
    the gather's launch node), and the call keeps only this rank's shard of ``input_`` for
    backward, as stock sequence parallelism does
    (:func:`~megatron_domino.communication.saved_shards.keeping_input_shards`).

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
    accumulate = module.gradient_accumulation_fusion and hasattr(module.weight, "main_grad")
    slot, chunk.dgrad_slot = chunk.dgrad_slot, None
    if runtime.sequence_parallel and getattr(module, "output_dtype", None) is None:
        # dX's reduce-scatter launched by the GEMM's backward, between its dgrad and dW.
        with keeping_input_shards(chunk.input_regather, input_, module):
            output = column_linear_async_dgrad(input_, module.weight, bias, slot, accumulate)
        time_backward(
            output, runtime.recorder, f"{step.sublayer}_column_gemm", step.layer, chunk.index
        )
    elif runtime.sequence_parallel:
        # Megatron-Core 0.20's output_dtype: its own GEMM path; _GatherWait launches dX's scatter.
        with keeping_input_shards(chunk.input_regather, input_, module):
            output = module._forward_impl(
                input=input_,
                weight=module.weight,
                bias=bias,
                gradient_accumulation_fusion=module.gradient_accumulation_fusion,
                allreduce_dgrad=False,
                sequence_parallel=False,
                tp_group=None,
                grad_output_buffer=None,
                **output_dtype_option(module),
            )
        time_backward(
            output, runtime.recorder, f"{step.sublayer}_column_gemm", step.layer, chunk.index
        )
    else:
        if getattr(module, "output_dtype", None) is not None:
            raise RuntimeError(
                f"Domino: this column-parallel linear asks for output_dtype "
                f"{module.output_dtype}, which the backward-overlap GEMM does not produce; "
                "build it without output_dtype, or use --sequence-parallel or "
                "--no-domino-backward-overlap (both run Megatron's own GEMM path)."
            )
        output = column_linear_async_dgrad(input_, module.weight, bias, slot, accumulate)
    one_placeholder_per_call(output, module.weight, chunk=chunk.index, legs=step.legs is not None)
    return output, module.bias if module.skip_bias_add else None
