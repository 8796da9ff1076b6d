"""Every collective Domino runs, from the launch that starts it to the wait that ends it.

Megatron-Core launches a tensor-parallel collective and waits for it in the same call. Domino
launches it at one point of the schedule and waits at a later one, after another chunk's work
was issued; between the two, the collective is *in flight*. :class:`InFlight` is that state,
for every kind: it starts the collective(s) asynchronously, records the launch and the wait
with the event recorder (:mod:`megatron_domino.base.recorder`), refuses a second launch before the
wait, and drops the handles once waited. The kinds:

* :class:`ForwardAllReduce`: one column piece of a row-parallel linear's partial sum
  ``[s, b/p, h/k]``, all-reduced in place in forward (backward: identity, Megatron's "g"
  operator; the row linear's output gradient is already replicated on every TP rank);
* :class:`DgradAllReduce`: a column-parallel linear's input gradient ``[s, b/p, h]``,
  launched by its backward and waited by the identity on its input
  (:mod:`megatron_domino.engine.backward_overlap`);
* :class:`SequenceCollective`: under sequence parallelism, an all-gather or reduce-scatter
  along ``s``, reused by the forward collective and its backward twin
  (:mod:`megatron_domino.communication.sequence_parallel`); under FP8 on TE layers the forward all-gather
  moves the FP8 bits of the shard, as stock TE's does (:mod:`megatron_domino.communication.te_fp8_inputs`).

The sequence-parallel re-gather of a column linear's saved input
(:class:`~megatron_domino.communication.saved_shards.SavedInputRegather`) is an :class:`InFlight` too: the
all-gathers of every tensor it kept, launched and waited as one collective.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_domino.base.recorder import LAUNCH, WAIT_BEGIN, WAIT_END, CollectiveLabel
from megatron_domino.communication.te_fp8_inputs import quantized_gather

__all__ = ["DgradAllReduce", "ForwardAllReduce", "InFlight", "SequenceCollective"]


class InFlight:
    """A collective (or several launched together, recorded as one) between launch and wait.

    Args:
        group: the tensor-parallel process group.
        label: recorder label (collective name, layer, chunk).
        piece: the column piece it belongs to (row-parallel outputs split into ``k``), else 0.
    """

    def __init__(self, group: dist.ProcessGroup, label: CollectiveLabel, piece: int = 0) -> None:
        self.group = group
        self.label = label
        self.piece = piece
        self._works: list = []
        self._direction = "fwd"
        self._id: int | None = None

    @property
    def pending(self) -> bool:
        """Launched and not yet waited."""
        return bool(self._works)

    def start(self, direction: str, launch: Callable[[], list]) -> None:
        """Run ``launch()``, which starts the collective(s) with ``async_op=True`` and returns
        their handles; record the launch (``direction``: ``fwd`` or ``bwd``)."""
        if self._works:
            label = self.label
            raise RuntimeError(
                f"{label.name} of layer {label.layer} chunk {label.chunk} launched twice "
                "without a wait."
            )
        self._id = self.label.recorder.new_collective_id()
        self._direction = direction
        self._works = list(launch())
        self._record(LAUNCH)

    def finish(self) -> None:
        """Block until every collective of the launch has completed; record the wait."""
        self._record(WAIT_BEGIN)
        for work in self._works:
            work.wait()
        self._record(WAIT_END)
        self._works = []

    def _record(self, kind: str) -> None:
        label = self.label
        label.recorder.record(
            kind, label.name, label.layer, label.chunk, self._direction, self.piece, self._id
        )


class _LaunchAllReduce(torch.autograd.Function):
    """Forward: start the in-place async all-reduce of ``partial``; backward: identity."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, slot: ForwardAllReduce):
        slot.start("fwd", lambda: [dist.all_reduce(partial, group=slot.group, async_op=True)])
        return partial

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return grad_output, None


class ForwardAllReduce(InFlight):
    """One piece of a row-parallel output ``[s, b/p, h/k]``, all-reduced in place.

    :meth:`launch` returns the tensor that holds the sum once :meth:`finish` returned; reading
    it before would read this rank's unreduced partial sum.
    """

    def launch(self, partial: torch.Tensor) -> torch.Tensor:
        """Start the all-reduce of the contiguous ``partial``; its autograd output."""
        return _LaunchAllReduce.apply(partial, self)


class DgradAllReduce(InFlight):
    """The input-gradient all-reduce of one column-parallel linear call for one chunk.

    Created in forward by the schedule, launched by the linear's backward (:meth:`launch`),
    waited by the backward of the identity on the linear's input (:meth:`wait`).
    """

    def __init__(self, group: dist.ProcessGroup, label: CollectiveLabel) -> None:
        super().__init__(group, label)
        self._buffer: torch.Tensor | None = None

    def launch(self, grad_input: torch.Tensor) -> None:
        """Start the in-place all-reduce of ``grad_input`` (``[s, b/p, h]``)."""
        self.start("bwd", lambda: [dist.all_reduce(grad_input, group=self.group, async_op=True)])
        self._buffer = grad_input

    def wait(self, grad: torch.Tensor) -> torch.Tensor:
        """Wait for the all-reduce and return the reduced gradient (``grad`` if none flies).

        ``grad`` must be the very tensor that was launched: if autograd had summed it with
        another consumer's gradient first, that sum would have read an unreduced buffer.
        """
        if not self.pending:
            return grad
        if grad is not self._buffer and grad.data_ptr() != self._buffer.data_ptr():
            raise RuntimeError(
                "Domino backward overlap needs the column-parallel linear to be the only "
                "consumer of its input; another op consumed it, so its gradient was summed "
                "with an in-flight all-reduce buffer. Disable with --no-domino-backward-overlap."
            )
        self.finish()
        reduced, self._buffer = self._buffer, None
        return reduced


def _gathered_shape(shard: torch.Tensor, group: dist.ProcessGroup) -> list[int]:
    return [shard.shape[0] * group.size(), *shard.shape[1:]]


def _scattered_shape(full: torch.Tensor, group: dist.ProcessGroup) -> list[int]:
    return [full.shape[0] // group.size(), *full.shape[1:]]


class SequenceCollective(InFlight):
    """An all-gather or reduce-scatter along the sequence, and its output buffer.

    A slot serves one direction at a time: forward fills and empties it, then backward reuses
    it for the collective that goes the other way.
    """

    def __init__(self, group: dist.ProcessGroup, label: CollectiveLabel, piece: int = 0) -> None:
        super().__init__(group, label, piece)
        self._output: torch.Tensor | None = None

    def all_gather(self, shard: torch.Tensor, direction: str) -> None:
        """Start gathering ``shard`` ``[s/tp, ...]`` into ``[s, ...]`` along the sequence."""
        output = shard.new_empty(_gathered_shape(shard, self.group))
        self._launch(dist.all_gather_into_tensor, output, shard.contiguous(), direction)

    def all_gather_quantized(self, quantized: torch.Tensor, quantizer, direction: str) -> None:
        """Start gathering the FP8 shard ``quantized`` ``[s/tp, ...]`` (Transformer Engine's
        ``Float8Tensor``) into an FP8 ``[s, ...]`` with TE's own all-gather of its bits
        (:func:`~megatron_domino.communication.te_fp8_inputs.quantized_gather`)."""

        def launch() -> list:
            self._output, works = quantized_gather(quantized, quantizer, self.group)
            return works

        self.start(direction, launch)

    def reduce_scatter(self, full: torch.Tensor, direction: str) -> None:
        """Start summing ``full`` ``[s, ...]`` over ranks, each keeping its ``[s/tp, ...]``."""
        output = full.new_empty(_scattered_shape(full, self.group))
        self._launch(dist.reduce_scatter_tensor, output, full.contiguous(), direction)

    def output_in_flight(self) -> torch.Tensor:
        """The output buffer before the wait: only to hand through autograd, never to read."""
        return self._output

    def wait(self) -> torch.Tensor:
        """Wait for the collective; its output."""
        self.finish()
        output, self._output = self._output, None
        return output

    def _launch(self, collective, output: torch.Tensor, tensor: torch.Tensor, direction: str):
        def launch() -> list:
            return [collective(output, tensor, group=self.group, async_op=True)]

        self.start(direction, launch)
        self._output = output
