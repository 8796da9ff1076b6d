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
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_domino.recorder import LAUNCH, WAIT_BEGIN, WAIT_END, CollectiveLabel


def _gathered_shape(shard: torch.Tensor, group: dist.ProcessGroup) -> list[int]:
    return [shard.shape[0] * group.size(), *shard.shape[1:]]


def _scattered_shape(full: torch.Tensor, group: dist.ProcessGroup) -> list[int]:
    return [full.shape[0] // group.size(), *full.shape[1:]]


class SequenceCollective:
    """One collective in flight: its handle, output buffer and recorder bookkeeping.

    A slot serves one direction at a time: forward fills and empties it, then backward reuses
    it for the collective that goes the other way.
    """

    def __init__(self, group: dist.ProcessGroup, label: CollectiveLabel, piece: int = 0) -> None:
        self.group = group
        self.label = label
        self.piece = piece
        self._work = None
        self._output: torch.Tensor | None = None
        self._id: int | None = None

    @property
    def pending(self) -> bool:
        return self._work is not None

    def all_gather(self, shard: torch.Tensor, direction: str) -> None:
        """Start gathering ``shard`` ``[s/tp, ...]`` into ``[s, ...]`` along the sequence."""
        output = shard.new_empty(_gathered_shape(shard, self.group))
        self._start(dist.all_gather_into_tensor, output, shard.contiguous(), direction)

    def reduce_scatter(self, full: torch.Tensor, direction: str) -> None:
        """Start summing ``full`` ``[s, ...]`` over ranks, each keeping its ``[s/tp, ...]``."""
        output = full.new_empty(_scattered_shape(full, self.group))
        self._start(dist.reduce_scatter_tensor, output, full.contiguous(), direction)

    def output_in_flight(self) -> torch.Tensor:
        """The output buffer before the wait: only to hand through autograd, never to read."""
        return self._output

    def wait(self, direction: str) -> torch.Tensor:
        label = self.label
        rec = label.recorder
        rec.record(
            WAIT_BEGIN, label.name, label.layer, label.chunk, direction, self.piece, self._id
        )
        self._work.wait()
        rec.record(WAIT_END, label.name, label.layer, label.chunk, direction, self.piece, self._id)
        output, self._work, self._output = self._output, None, None
        return output

    def _start(
        self, collective, output: torch.Tensor, tensor: torch.Tensor, direction: str
    ) -> None:
        if self._work is not None:
            raise RuntimeError(
                f"{self.label.name} of layer {self.label.layer} chunk "
                f"{self.label.chunk} launched twice without a wait."
            )
        label = self.label
        self._id = label.recorder.new_collective_id()
        self._output = output
        self._work = collective(output, tensor, group=self.group, async_op=True)
        label.recorder.record(
            LAUNCH, label.name, label.layer, label.chunk, direction, self.piece, self._id
        )


class _GatherLaunch(torch.autograd.Function):
    """Forward: launch the all-gather of the norm output; backward: wait for the dX scatter."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, slot: SequenceCollective):
        ctx.slot = slot
        slot.all_gather(shard, "fwd")
        return shard.view_as(shard)

    @staticmethod
    def backward(ctx, grad_in_flight: torch.Tensor):
        if grad_in_flight.data_ptr() != ctx.slot.output_in_flight().data_ptr():
            raise RuntimeError(
                "Domino sequence parallelism needs the column-parallel linear to be the only "
                "consumer of its gathered input; another op consumed it."
            )
        return ctx.slot.wait("bwd"), None


class _GatherWait(torch.autograd.Function):
    """Forward: wait for the all-gather (``[s, b/p, h]``); backward: launch the dX scatter."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, slot: SequenceCollective):
        ctx.slot = slot
        return slot.wait("fwd")

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        ctx.slot.reduce_scatter(grad_full, "bwd")
        return ctx.slot.output_in_flight(), None


class _ScatterLaunch(torch.autograd.Function):
    """Forward: launch the reduce-scatter of a partial sum; backward: wait for the dY gather."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, slot: SequenceCollective):
        ctx.slot = slot
        slot.reduce_scatter(partial, "fwd")
        return slot.output_in_flight()

    @staticmethod
    def backward(ctx, grad_in_flight: torch.Tensor):
        return ctx.slot.wait("bwd"), None


class _ScatterWait(torch.autograd.Function):
    """Forward: wait for the reduce-scatter (``[s/tp, ...]``); backward: launch the dY gather."""

    @staticmethod
    def forward(ctx, in_flight: torch.Tensor, slot: SequenceCollective):
        ctx.slot = slot
        return slot.wait("fwd").view_as(in_flight)

    @staticmethod
    def backward(ctx, grad_shard: torch.Tensor):
        # The gathered gradient reaches _ScatterLaunch through the slot; autograd needs a
        # gradient of the shard's shape on this edge, which _ScatterLaunch ignores.
        ctx.slot.all_gather(grad_shard, "bwd")
        return grad_shard, None


def launch_gather(shard, slot):
    """Norm op: start the all-gather of ``shard`` ``[s/tp, b/p, h]``."""
    return _GatherLaunch.apply(shard, slot)


def wait_gather(launched, slot):
    """Core op: the gathered input ``[s, b/p, h]`` of the column-parallel linear."""
    return _GatherWait.apply(launched, slot)


def launch_scatter(partial, slot):
    """Projection op: start the reduce-scatter of ``partial`` ``[s, b/p, h/k]``."""
    return _ScatterLaunch.apply(partial, slot)


def wait_scatter(in_flight, slot):
    """Next norm op: the reduced shard ``[s/tp, b/p, h/k]``."""
    return _ScatterWait.apply(in_flight, slot)
