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

from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_domino.recorder import LAUNCH, WAIT_BEGIN, WAIT_END, CollectiveLabel
from megatron_domino.sequence_parallel import (
    SequenceCollective,
    launch_scatter,
    wait_scatter,
)


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
    """The row-parallel output of one chunk whose collective(s) are in flight.

    Holds ``k`` partial sums (one per column piece, each ``[s, b/p, h/k]``) and the means to
    wait for them. Without sequence parallelism each piece is all-reduced in place; with it,
    reduce-scattered along ``s`` to ``[s/tp, b/p, h/k]`` (see
    :mod:`megatron_domino.sequence_parallel`). Reading a piece before :meth:`wait` would read
    an unreduced partial sum, so pieces are only reachable through :meth:`wait`.

    Args:
        group: the tensor-parallel process group.
        label: recorder label (collective name, layer, chunk).
        bias: added after the reduction when the linear does not return its bias separately
            (``skip_bias_add=False``), as Megatron-Core does.
        scatter: reduce-scatter along the sequence instead of all-reducing.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        label: CollectiveLabel,
        bias: torch.Tensor | None = None,
        scatter: bool = False,
    ) -> None:
        self._group = group
        self._label = label
        self._bias = bias
        self._scatter = scatter
        self._waits: list = []

    def launch(self, partial: torch.Tensor) -> None:
        """Start the collective of the next column piece ``partial`` (``[s, b/p, h/k]``)."""
        piece = len(self._waits)
        if self._scatter:
            slot = SequenceCollective(self._group, self._label, piece)
            in_flight = launch_scatter(partial, slot)
            self._waits.append(lambda then=None: wait_scatter(in_flight, slot, then))
        else:
            self._waits.append(self._launch_all_reduce(partial.contiguous(), piece))

    def _launch_all_reduce(self, partial: torch.Tensor, piece: int):
        label, works = self._label, []
        collective = label.recorder.new_collective_id()
        reduced = _LaunchAllReduce.apply(partial, self._group, works)
        label.recorder.record(
            LAUNCH, label.name, label.layer, label.chunk, "fwd", piece, collective
        )

        def wait(then=None) -> torch.Tensor:
            label.recorder.record(
                WAIT_BEGIN, label.name, label.layer, label.chunk, "fwd", piece, collective
            )
            works[0].wait()
            label.recorder.record(
                WAIT_END, label.name, label.layer, label.chunk, "fwd", piece, collective
            )
            return reduced

        return wait

    @property
    def in_flight(self) -> bool:
        return bool(self._waits)

    def wait(self, then_in_backward: Callable[[], None] | None = None) -> torch.Tensor:
        """Wait for every piece; the reduced output ``[s or s/tp, b/p, h]`` (pieces joined on h).

        Under sequence parallelism, ``then_in_backward`` runs in backward right after the
        reduce-scatters' twins have launched their output-gradient all-gathers (the schedule
        passes the launch of the chunk's column-linear input re-gather).
        """
        if not self._waits:
            raise RuntimeError(
                f"{self._label.name} of layer {self._label.layer} chunk "
                f"{self._label.chunk} was waited twice or never launched."
            )
        if then_in_backward is not None and not self._scatter:
            raise RuntimeError("then_in_backward applies to reduce-scatters only.")
        # Piece 0's twin is the last of the pieces' to run in backward.
        pieces = [wait(then_in_backward if i == 0 else None) for i, wait in enumerate(self._waits)]
        self._waits.clear()
        output = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)
        return output if self._bias is None else output + self._bias
