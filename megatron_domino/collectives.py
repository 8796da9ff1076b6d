"""Asynchronous tensor-parallel collectives, in flight between a launch and a late wait.

Megatron-Core's row-parallel linear all-reduces its partial sum ``[s, b, h]`` with a
blocking call. Domino instead *launches* the all-reduce of each chunk (and each column piece)
and hands back a :class:`PendingReduce`; the schedule computes another chunk and only then
calls :meth:`PendingReduce.wait`. This module is the only place forward collectives are
launched and waited, and each launch and wait is reported to the recorder.

Autograd: the forward all-reduce sums partial outputs of identical-shaped shards, so its
backward is the identity (Megatron's "g" operator in ``mappings.py``): the gradient of the
row-parallel output is already replicated on every tensor-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_domino.recorder import LAUNCH, NULL_RECORDER, WAIT_BEGIN, WAIT_END, NullRecorder


@dataclass(frozen=True)
class CollectiveLabel:
    """Where a collective belongs, for the recorder: e.g. ``attention_ar`` of layer 3, chunk 1."""

    name: str
    layer: int
    chunk: int
    recorder: NullRecorder = NULL_RECORDER


class _LaunchAllReduce(torch.autograd.Function):
    """Forward: start an in-place async all-reduce of ``partial``; backward: identity."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group: dist.ProcessGroup, works: list):
        works.append(dist.all_reduce(partial, group=group, async_op=True))
        return partial

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return grad_output, None, None


class PendingReduce:
    """The row-parallel output of one chunk whose all-reduce(s) are in flight.

    Holds ``k`` partial sums (one per column piece, each ``[s, b/p, h/k]``) and their
    communication handles. Reading the pieces before :meth:`wait` would read unreduced
    partial sums, so they are only reachable through :meth:`wait`.

    Args:
        group: the tensor-parallel process group.
        label: recorder label (collective name, layer, chunk).
        bias: added after the reduction when the linear does not return its bias separately
            (``skip_bias_add=False``), as Megatron-Core does.
    """

    def __init__(
        self, group: dist.ProcessGroup, label: CollectiveLabel, bias: torch.Tensor | None = None
    ) -> None:
        self._group = group
        self._label = label
        self._bias = bias
        self._pieces: list[torch.Tensor] = []
        self._works: list = []
        self._ids: list[int | None] = []

    def launch(self, partial: torch.Tensor) -> None:
        """Start the all-reduce of the next column piece ``partial`` (``[s, b/p, h/k]``)."""
        label = self._label
        piece = len(self._pieces)
        collective = label.recorder.new_collective_id()
        self._pieces.append(_LaunchAllReduce.apply(partial.contiguous(), self._group, self._works))
        self._ids.append(collective)
        label.recorder.record(
            LAUNCH, label.name, label.layer, label.chunk, "fwd", piece, collective
        )

    @property
    def in_flight(self) -> bool:
        return bool(self._works)

    def wait(self) -> torch.Tensor:
        """Wait for every piece and return the reduced output ``[s, b/p, h]`` (pieces joined on h)."""
        if not self._works:
            raise RuntimeError(
                f"{self._label.name} of layer {self._label.layer} chunk "
                f"{self._label.chunk} was waited twice or never launched."
            )
        label = self._label
        for piece, (work, collective) in enumerate(zip(self._works, self._ids, strict=True)):
            label.recorder.record(
                WAIT_BEGIN, label.name, label.layer, label.chunk, "fwd", piece, collective
            )
            work.wait()
            label.recorder.record(
                WAIT_END, label.name, label.layer, label.chunk, "fwd", piece, collective
            )
        self._works.clear()
        output = self._pieces[0] if len(self._pieces) == 1 else torch.cat(self._pieces, dim=-1)
        self._pieces.clear()
        return output if self._bias is None else output + self._bias
