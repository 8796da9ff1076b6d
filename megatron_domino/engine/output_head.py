"""The output layer's input gradient, all-reduced per chunk and waited inside the block.

After the transformer block, ``GPTModel`` runs the final norm and the output layer (the LM
head, a column-parallel linear ``[s, b, h] -> [s, b, V/tp]``) on the whole micro-batch. In
backward, Megatron-Core's linear all-reduces the head's input gradient ``dX [s, b, h]`` while
it computes its own ``dW``, then waits: nothing else can run, because all of the block's
backward needs ``dX``. That all-reduce is as large as a layer's, and on a short model it is a
large part of what Domino leaves exposed in backward.

Domino moves the final norm into the schedule, per chunk (it is per token, so the values are
the stock ones), and places on each chunk's norm output the same backward wait as before a
column linear (:func:`~megatron_domino.engine.backward_overlap.wait_for_dgrad_reduce`). The output
layer then takes the chunks' outputs as its inputs (:class:`_OutputLayerChunkedDgrad`): its
backward computes each chunk's ``dX_c = dY_c @ W`` (``[s, b/p, h]``), launches its
all-reduce, last chunk first (the first whose backward runs), computes ``dW`` on the whole
micro-batch, and returns the chunks' gradients still in flight. Chunk ``p-1``'s wait comes
first; while it and its last layer's backward run, the other chunks' all-reduces fly.

In forward, each chunk's logits ``[s, b/p, V/tp]`` are computed inside the schedule, one op
after its final norm (:func:`chunk_logits`): chunk ``c``'s logits GEMM then runs while the
later chunks' last all-reduces fly, where stock (and the joined output layer) could only wait
for the last chunk before the one GEMM of the whole micro-batch. They are computed without
autograd, by calling the output layer as a module (its hooks run, as DDP's parameter-gather
wait needs), into one ``[s, b, V/tp]`` tensor that :class:`_OutputLayerChunkedDgrad` returns
instead of multiplying again; its node is still created where the output layer is called, so
the backward above is unchanged. The loss stays on the joined logits, as stock computes it:
its vocab-parallel all-reduces would queue on the same wire behind the last chunk's.

The hand-off from the block to the output layer is a :class:`~megatron_domino.engine.end_handoffs.HeadHandoff` on the runtime: the
block records the joined output it returns with the chunk outputs behind it; the output layer's
bound forward takes the hand-off only for that very tensor. A hand-off never taken leaves the
waits with nothing in flight, so they pass the gradient through.

It applies where the output layer is Megatron-Core's own ``ColumnParallelLinear`` with no
bias, no gathered output and no deferred embedding weight gradient, without sequence
parallelism (the head's collectives are then an all-gather and a reduce-scatter) and
multi-token prediction (a second consumer of the block output):
:func:`output_layer_problems` says which does not hold. Nor does it where the block's last
layer range is recomputed (full activation recompute) or autograd is off. Elsewhere the stock
final norm and output layer run. It is part of backward overlap (``--no-domino-backward-overlap``
turns it off with the rest).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from megatron.core.tensor_parallel import layers as megatron_layers
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

from megatron_domino.base.recorder import CollectiveLabel
from megatron_domino.communication.collectives import HEAD_DGRAD_AR, DgradAllReduce
from megatron_domino.engine.backward_overlap import wait_for_dgrad_reduce, weight_gradient
from megatron_domino.engine.chunking import SPLIT_DIMS

if TYPE_CHECKING:
    from megatron_domino.engine.end_handoffs import HeadHandoff
    from megatron_domino.engine.state import ChunkState, DominoRuntime

__all__ = [
    "chunk_logits",
    "output_layer_forward",
    "output_layer_problems",
    "place_head_wait",
]


def output_layer_problems(model: torch.nn.Module, chunks: int) -> list[str]:
    """Why ``model``'s output layer cannot take its ``chunks`` chunks' gradients in flight
    (module docstring); empty when it can. ``model`` is a ``GPTModel`` or ``HybridModel`` (one
    pipeline stage)."""
    head = getattr(model, "output_layer", None)
    if not getattr(model, "post_process", False) or head is None:
        return ["this pipeline stage has no output layer"]
    config = model.config
    checks = {
        "one chunk (its all-reduce would have nothing but its own dW to hide behind, as stock)": (
            chunks < 2
        ),
        "the output layer is not Megatron-Core's ColumnParallelLinear": type(head)
        is not ColumnParallelLinear,
        "the output layer has a bias": head.bias is not None,
        "the output layer gathers its output": head.gather_output,
        "sequence parallelism": head.sequence_parallel,
        "deferred embedding weight gradients": config.defer_embedding_wgrad_compute,
        "multi-token prediction": bool(config.mtp_num_layers),
    }
    return [problem for problem, present in checks.items() if present]


def place_head_wait(runtime: DominoRuntime, final_layernorm, layer: int, chunk: ChunkState):
    """The schedule's last op of a chunk: the final norm of its residual stream, with the
    backward wait of the output layer's input-gradient all-reduce on the result."""
    label = CollectiveLabel(HEAD_DGRAD_AR, layer, chunk.index, runtime.recorder)
    slot = DgradAllReduce(runtime.tp_group, label)
    runtime.step.head_slots.append(slot)
    chunk.hidden = wait_for_dgrad_reduce(final_layernorm(chunk.hidden), slot)


def chunk_logits(model: torch.nn.Module, runtime: DominoRuntime, chunk: ChunkState) -> None:
    """The schedule's op after a chunk's final norm: its logits ``[s, b/p, V/tp]``, written
    into its rows of the micro-batch's logits ``[s, b, V/tp]`` (the step's ``head_logits``,
    made by the first chunk), without autograd.

    ``model`` is the ``GPTModel`` whose output layer is called as a module, with the weight
    ``GPTModel`` passes it (the word embeddings' where they are shared); the step's
    ``head_weight`` records which, so that the output layer's call uses the logits only for that weight.
    """
    output_weight = None
    if model.share_embeddings_and_output_weights:
        output_weight = model.shared_embedding_or_output_weight()
    with torch.no_grad():
        logits, _ = model.output_layer(chunk.hidden, weight=output_weight)
    step, split_dim = runtime.step, SPLIT_DIMS[runtime.config.split_along]
    if step.head_logits is None:
        shape = list(logits.shape)
        shape[split_dim] = sum(other.hidden.shape[split_dim] for other in step.chunks)
        step.head_logits = logits.new_empty(shape)
        step.head_weight = model.output_layer.weight if output_weight is None else output_weight
    start = sum(other.hidden.shape[split_dim] for other in step.chunks[: chunk.index])
    step.head_logits.narrow(split_dim, start, logits.shape[split_dim]).copy_(logits)


def output_layer_forward(
    module: ColumnParallelLinear,
    input_: torch.Tensor,
    weight: torch.Tensor | None = None,
    runtime_gather_output: bool | None = None,
    *,
    runtime: DominoRuntime,
):
    """The bound ``forward`` of the output layer: the stock one, unless ``input_`` is the
    block output of a :class:`~megatron_domino.engine.end_handoffs.HeadHandoff`, whose chunk gradients it then leaves in flight.

    Returns:
        ``(logits [s, b, V/tp], None)``, as Megatron-Core's forward with no bias.
    """
    handoff, runtime.head_handoff = runtime.head_handoff, None
    if handoff is None or handoff.joined is not input_ or runtime_gather_output:
        return ColumnParallelLinear.forward(module, input_, weight, runtime_gather_output)
    weight = module.weight if weight is None else weight
    accumulate = module.gradient_accumulation_fusion and hasattr(weight, "main_grad")
    logits = _OutputLayerChunkedDgrad.apply(handoff, accumulate, input_, weight, *handoff.chunks)
    return logits, None


class _OutputLayerChunkedDgrad(torch.autograd.Function):
    """``logits = X @ W^T`` on the joined ``X``; backward: per-chunk ``dX`` left in flight.

    Inputs: the hand-off, the joined block output ``X`` ``[s, b, h]`` (read in forward only
    where the hand-off has no logits computed per chunk with ``W``, :func:`chunk_logits`;
    given no gradient) and ``W`` ``[V/tp, h]``, then the chunk outputs ``X`` is made of (not
    read; the gradients go to them). Autocast-decorated like Megatron-Core's linear.
    """

    @staticmethod
    @megatron_layers.custom_fwd
    def forward(ctx, handoff: HeadHandoff, accumulate_in_main_grad: bool, joined, weight, *chunks):
        ctx.save_for_backward(joined, weight)
        # Not the hand-off itself: it holds the chunk outputs, which backward does not need.
        ctx.slots, ctx.split_dim = handoff.slots, handoff.split_dim
        ctx.sizes = [chunk.shape[handoff.split_dim] for chunk in chunks]
        ctx.accumulate_in_main_grad = accumulate_in_main_grad
        if handoff.logits is not None and handoff.logits_weight is weight:
            return handoff.logits
        return torch.matmul(joined, weight.t())

    @staticmethod
    @megatron_layers.custom_bwd
    def backward(ctx, grad_output):
        joined, weight = ctx.saved_tensors
        pieces = grad_output.split(ctx.sizes, dim=ctx.split_dim)
        grads = [None] * len(pieces)
        # The last chunk's wait runs first in backward: its all-reduce goes first on the wire.
        for index in reversed(range(len(pieces))):
            grads[index] = pieces[index].matmul(weight)
            ctx.slots[index].launch(grads[index])
        grad_weight = None
        if ctx.needs_input_grad[3]:
            grad_2d, input_2d = prepare_input_tensors_for_wgrad_compute(grad_output, joined)
            grad_weight = weight_gradient(weight, grad_2d, input_2d, ctx.accumulate_in_main_grad)
        return None, None, None, grad_weight, *grads
