"""Opt-in event recorder: when each chunk computed and when each collective flew.

Domino's claim is that collectives run *while other chunks compute*. The recorder keeps the
evidence: for every layer and chunk, the begin/end of each compute region, and for every
collective its launch, the begin of the wait and the end of the wait, forward and backward.
Tests assert on the recorded order; the benchmark and the overlap report derive exposed
communication time from it.

It is free when off: the schedule holds :data:`NULL_RECORDER`, whose methods do nothing and
whose ``region`` returns one shared ``nullcontext``. On GPU each event also records a CUDA event
on the current stream, so times are device times, not the (asynchronous) launch times.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

#: Event kinds: compute regions, and the three moments of a collective's life.
BEGIN, END, LAUNCH, WAIT_BEGIN, WAIT_END = "begin", "end", "launch", "wait_begin", "wait_end"


@dataclass(frozen=True)
class Event:
    """One recorded moment.

    Attributes:
        kind: one of ``begin``/``end`` (compute region) or ``launch``/``wait_begin``/``wait_end``.
        name: region name (e.g. ``attention_core``) or collective name (e.g. ``attention_ar``).
        layer: 0-based layer index in the block.
        chunk: row chunk index (batch slice) the work belongs to.
        piece: column piece index for row-parallel GEMMs split into pieces, else 0.
        direction: ``fwd`` or ``bwd``.
        time_s: seconds since the recorder's first event (device time on GPU).
        collective: id shared by a collective's launch and wait events; ``None`` for regions.
    """

    kind: str
    name: str
    layer: int
    chunk: int
    piece: int
    direction: str
    time_s: float
    collective: int | None = None


class NullRecorder:
    """The recorder used when recording is off: every method is a no-op that takes
    :class:`EventRecorder`'s arguments and ignores them."""

    enabled = False
    _NULL_CONTEXT = contextlib.nullcontext()

    def region(self, *_where, **_named) -> contextlib.AbstractContextManager[None]:
        return self._NULL_CONTEXT

    def record(self, *_event, **_named) -> None:
        """Records nothing."""

    def new_collective_id(self) -> int | None:
        return None


NULL_RECORDER = NullRecorder()


@dataclass(frozen=True)
class CollectiveLabel:
    """Where a collective belongs, for the recorder: e.g. ``attention_ar`` of layer 3, chunk 1."""

    name: str
    layer: int
    chunk: int
    recorder: NullRecorder = NULL_RECORDER


class EventRecorder(NullRecorder):
    """Records :class:`Event` s in call order; read them with :meth:`events`.

    Args:
        use_cuda_events: also record a ``torch.cuda.Event`` per event and report device times;
            defaults to whether CUDA is available.
    """

    enabled = True

    def __init__(self, use_cuda_events: bool | None = None) -> None:
        self.use_cuda_events = (
            torch.cuda.is_available() if use_cuda_events is None else use_cuda_events
        )
        self._raw: list[tuple[tuple, int, object]] = []
        self._ids = itertools.count()

    @contextlib.contextmanager
    def region(
        self, name: str, layer: int, chunk: int, direction: str = "fwd", piece: int = 0
    ) -> Iterator[None]:
        self.record(BEGIN, name, layer, chunk, direction, piece)
        try:
            yield
        finally:
            self.record(END, name, layer, chunk, direction, piece)

    def record(
        self,
        kind: str,
        name: str,
        layer: int,
        chunk: int,
        direction: str,
        piece: int = 0,
        collective: int | None = None,
    ) -> None:
        cuda_event = None
        if self.use_cuda_events:
            cuda_event = torch.cuda.Event(enable_timing=True)
            cuda_event.record()
        self._raw.append(
            (
                (kind, name, layer, chunk, piece, direction, collective),
                time.perf_counter_ns(),
                cuda_event,
            )
        )

    def new_collective_id(self) -> int:
        return next(self._ids)

    def clear(self) -> None:
        """Forget recorded events (e.g. after warm-up iterations)."""
        self._raw.clear()

    def events(self) -> list[Event]:
        """All events so far, in record order, with times relative to the first event."""
        if not self._raw:
            return []
        if self.use_cuda_events:
            torch.cuda.synchronize()
            first = self._raw[0][2]
            times = [first.elapsed_time(ev) / 1e3 for _, _, ev in self._raw]
        else:
            t0 = self._raw[0][1]
            times = [(ns - t0) / 1e9 for _, ns, _ in self._raw]
        return [
            Event(
                kind=k,
                name=n,
                layer=layer,
                chunk=c,
                piece=piece,
                direction=d,
                time_s=t,
                collective=coll,
            )
            for ((k, n, layer, c, piece, d, coll), _, _), t in zip(self._raw, times, strict=True)
        ]


def time_backward(
    tensor: torch.Tensor, recorder: NullRecorder, name: str, layer: int, chunk: int, piece: int = 0
) -> None:
    """Record region ``name`` in backward around the autograd node that produced ``tensor``.

    Uses the node's pre-hook and post-hook, so it adds no node to the graph and cannot change
    the order in which the autograd engine runs the backward.
    """
    node = tensor.grad_fn
    if not recorder.enabled or node is None:
        return
    node.register_prehook(
        lambda grad_outputs: recorder.record(BEGIN, name, layer, chunk, "bwd", piece)
    )
    node.register_hook(
        lambda grad_inputs, grad_outputs: recorder.record(END, name, layer, chunk, "bwd", piece)
    )
