"""Sequence-parallel collectives for Domino: all-gathers and reduce-scatters in flight.

Under sequence parallelism the residual stream is ``[s/tp, b, h]``: each tensor-parallel rank
holds ``s/tp`` tokens. A column-parallel linear needs the whole sequence, so its input is
all-gathered along ``s``; a row-parallel linear's partial sums ``[s, b, h]`` are reduce-scattered
back to ``[s/tp, b, h]``. In backward the roles swap: the column linear's input gradient is
reduce-scattered, the row linear's output gradient all-gathered.

Each collective is split into two autograd nodes, created at the two points of the schedule
where Domino launches and waits it in forward (another chunk's op is created in between):

* :class:`_GatherLaunch` (norm op) / :class:`_GatherWait` (core op): the forward all-gather of
  a column linear's input; in backward, ``_GatherWait`` launches the reduce-scatter of the
  input gradient right after the linear's backward, ``_GatherLaunch`` waits for it.
* :class:`_ScatterLaunch` (projection op) / :class:`_ScatterWait` (next norm op): the forward
  reduce-scatter of a row linear's output; in backward, ``_ScatterWait`` launches the
  all-gather of the output gradient, ``_ScatterLaunch`` waits for it.

The autograd engine runs the other chunk's nodes (created between the pair) while each
backward collective flies, as for the input-gradient all-reduce without sequence parallelism.

The slots the pairs share are :class:`~megatron_domino.communication.collectives.SequenceCollective` s. A
third collective per column linear, the backward re-gather of the input shard it keeps
(:mod:`megatron_domino.communication.saved_shards`), is launched by ``_ScatterWait``'s backward through the
``then`` it is given.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_domino.communication.collectives import SequenceCollective
from megatron_domino.communication.te_fp8_inputs import GatherUse, quantize_shard


class _GatherLaunch(torch.autograd.Function):
    """Forward: launch the all-gather of the norm output (of its FP8 cast ``quantized``, when
    given, with its ``quantizer``); backward: wait for the dX scatter (in the shard's dtype)."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, slot: SequenceCollective, quantized, quantizer):
        ctx.slot = slot
        if quantized is None:
            slot.all_gather(shard, "fwd")
        else:
            slot.all_gather_quantized(quantized, quantizer, GatherUse.FPROP_INPUT, "fwd")
        return shard.view_as(shard)

    @staticmethod
    def backward(ctx, grad_in_flight: torch.Tensor):
        if grad_in_flight.data_ptr() != ctx.slot.output_in_flight().data_ptr():
            raise RuntimeError(
                "Domino sequence parallelism needs the column-parallel linear to be the only "
                "consumer of its gathered input; another op consumed it."
            )
        return ctx.slot.wait(), None, None, None


class _GatherWait(torch.autograd.Function):
    """Forward: wait for the all-gather (``[s, b/p, h]``); backward: launch the dX scatter,
    unless the column linear's backward launched it already (:class:`InputGradientScatter`)."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, slot: SequenceCollective):
        ctx.slot = slot
        return slot.wait()

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        if not ctx.slot.pending:  # Transformer Engine's linear: after its whole backward
            InputGradientScatter(ctx.slot).launch(grad_full)
        return ctx.slot.output_in_flight(), None


class InputGradientScatter:
    """A column linear's input-gradient collective under sequence parallelism: the
    reduce-scatter of ``dX`` ``[s, b/p, h] -> [s/tp, b/p, h]`` on the chunk's gather slot,
    launched by the linear's own backward between its dgrad and dW GEMMs
    (:class:`~megatron_domino.engine.backward_overlap._ColumnLinearAsyncDgrad`, Megatron's local
    linears), so that the linear's dW runs while it flies, as for the all-reduce without
    sequence parallelism. :class:`_GatherWait`'s backward then finds it launched; Transformer
    Engine's linear, whose dW runs inside its own backward, leaves the launch to it.
    """

    def __init__(self, slot: SequenceCollective) -> None:
        self.slot = slot
        self.label = slot.label

    def launch(self, grad_full: torch.Tensor) -> None:
        """Start the reduce-scatter of ``grad_full`` ``[s, b/p, h]``."""
        self.slot.reduce_scatter(grad_full, "bwd")


class _ScatterLaunch(torch.autograd.Function):
    """Forward: launch the reduce-scatter of a partial sum; backward: wait for the dY gather."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, slot: SequenceCollective):
        ctx.slot = slot
        slot.reduce_scatter(partial, "fwd")
        return slot.output_in_flight()

    @staticmethod
    def backward(ctx, grad_in_flight: torch.Tensor):
        return ctx.slot.wait(), None


class _ScatterWait(torch.autograd.Function):
    """Forward: wait for the reduce-scatter (``[s/tp, ...]``); backward: launch the dY gather
    (in FP8 with ``grad_quantizer`` when given, a current-scaling cast's amax reduced over
    ``amax_group``), then ``then`` (the re-gather of the chunk's column-linear input, if any)."""

    @staticmethod
    def forward(
        ctx, in_flight: torch.Tensor, slot: SequenceCollective, then, grad_quantizer, amax_group
    ):
        ctx.slot, ctx.then, ctx.grad_quantizer = slot, then, grad_quantizer
        ctx.amax_group = amax_group
        return slot.wait().view_as(in_flight)

    @staticmethod
    def backward(ctx, grad_shard: torch.Tensor):
        # The gathered gradient reaches _ScatterLaunch through the slot; autograd needs a
        # gradient of the shard's shape on this edge, which _ScatterLaunch ignores.
        quantizer = ctx.grad_quantizer
        if quantizer is None:
            ctx.slot.all_gather(grad_shard, "bwd")
        else:
            quantized = quantize_shard(quantizer, grad_shard, ctx.amax_group)
            ctx.slot.all_gather_quantized(quantized, quantizer, GatherUse.GRAD_OUTPUT, "bwd")
        if ctx.then is not None:
            ctx.then()
        return grad_shard, None, None, None, None


def launch_gather(shard, slot, quantized=None, quantizer=None):
    """Norm op: start the all-gather of ``shard`` ``[s/tp, b/p, h]``, or of ``quantized``, its
    FP8 cast by ``quantizer`` (:mod:`megatron_domino.communication.te_fp8_inputs`)."""
    return _GatherLaunch.apply(shard, slot, quantized, quantizer)


def wait_gather(launched, slot):
    """Core op: the gathered input ``[s, b/p, h]`` of the column-parallel linear (an FP8
    tensor when its shard was cast)."""
    return _GatherWait.apply(launched, slot)


def launch_scatter(partial, slot):
    """Projection op: start the reduce-scatter of ``partial`` ``[s, b/p, h/k]``."""
    return _ScatterLaunch.apply(partial, slot)


def wait_scatter(
    in_flight, slot, then: Callable[[], None] | None = None, grad_quantizer=None, amax_group=None
):
    """Next norm op: the reduced shard ``[s/tp, b/p, h/k]``; ``then`` runs in backward right
    after the dY gather is launched (an FP8 gather when ``grad_quantizer`` is given, its cast's
    amax reduced over ``amax_group`` under current scaling)."""
    return _ScatterWait.apply(in_flight, slot, then, grad_quantizer, amax_group)
