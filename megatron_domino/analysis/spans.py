"""Turn recorded events into per-collective facts: in flight how long, exposed how long, and
which other chunk's (or piece's) compute ran while it flew.

A collective is *overlapped* when some compute region of another chunk, or of another column
piece of the same chunk, began or ended between its launch and the begin of its wait. Its
*exposed* time is the time the wait blocked (``wait_end - wait_begin``); its *in-flight* time
is ``wait_end - launch``. On a wire-bound link, the communication time that was hidden is
bounded by ``in_flight - exposed``.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_domino.base.recorder import BEGIN, END, LAUNCH, WAIT_BEGIN, WAIT_END, Event


@dataclass(frozen=True)
class CollectiveSpan:
    """One collective's life, from the recorder.

    Attributes:
        name: e.g. ``attention_ar`` (forward) or ``mlp_dgrad_ar`` (backward).
        layer, chunk, piece, direction: where it belongs.
        launch_s, wait_begin_s, wait_end_s: its three moments (seconds).
        overlapped_by: compute regions (``name``, layer, chunk, piece) of other chunks or
            pieces that began or ended while it flew, before its wait began.
        order: its launch order within its direction (0 = first launched).
    """

    name: str
    layer: int
    chunk: int
    piece: int
    direction: str
    launch_s: float
    wait_begin_s: float
    wait_end_s: float
    overlapped_by: tuple[tuple[str, int, int, int], ...]
    order: int

    @property
    def exposed_s(self) -> float:
        return self.wait_end_s - self.wait_begin_s

    @property
    def in_flight_s(self) -> float:
        return self.wait_end_s - self.launch_s


def collective_spans(events: list[Event]) -> list[CollectiveSpan]:
    """Pair each collective's launch and wait events, in launch order per direction.

    Raises:
        ValueError: if a collective was launched but never waited (the step leaked a handle).
    """
    launches: dict[int, tuple[int, Event]] = {}
    waits: dict[int, dict[str, tuple[int, Event]]] = {}
    for index, event in enumerate(events):
        if event.kind == LAUNCH:
            launches[event.collective] = (index, event)
        elif event.kind in (WAIT_BEGIN, WAIT_END):
            waits.setdefault(event.collective, {})[event.kind] = (index, event)
    unwaited = [launches[c][1] for c in launches if WAIT_END not in waits.get(c, {})]
    if unwaited:
        first = unwaited[0]
        raise ValueError(
            f"{len(unwaited)} collectives were never waited, e.g. {first.name} of "
            f"layer {first.layer} chunk {first.chunk} ({first.direction})."
        )
    spans = []
    order = {"fwd": 0, "bwd": 0}
    for collective, (launch_index, launch) in sorted(launches.items(), key=lambda kv: kv[1][0]):
        begin_index, wait_begin = waits[collective][WAIT_BEGIN]
        _, wait_end = waits[collective][WAIT_END]
        overlapped_by = tuple(
            dict.fromkeys(
                (e.name, e.layer, e.chunk, e.piece)
                for e in events[launch_index + 1 : begin_index]
                if e.kind in (BEGIN, END)
                and e.direction == launch.direction
                and (e.chunk != launch.chunk or e.piece != launch.piece)
            )
        )
        spans.append(
            CollectiveSpan(
                name=launch.name,
                layer=launch.layer,
                chunk=launch.chunk,
                piece=launch.piece,
                direction=launch.direction,
                launch_s=launch.time_s,
                wait_begin_s=wait_begin.time_s,
                wait_end_s=wait_end.time_s,
                overlapped_by=overlapped_by,
                order=order[launch.direction],
            )
        )
        order[launch.direction] += 1
    return spans


def overlap_share(in_flight_s: float, exposed_s: float) -> float | None:
    """The recorder's **overlap share**, ``1 - exposed / in_flight``: the share of collectives'
    in-flight time (launch to end of wait) during which the caller was not blocked in a wait;
    ``None`` with nothing in flight.

    Not the bench's *hidden fraction* (:mod:`lab.bench.metrics`, from step
    times against a run without communication): this one is read off launches and waits, so it
    is an upper bound on the share of the communication's own duration that was hidden (a
    collective that finished long before its wait counts as fully overlapped).
    """
    return 1.0 - exposed_s / in_flight_s if in_flight_s > 0 else None


class WithOverlapShare:
    """A record of collectives with their ``in_flight_s`` and ``exposed_s`` totals (fields of
    the dataclass that derives from it), and their :func:`overlap_share`."""

    in_flight_s: float
    exposed_s: float

    @property
    def overlap_share(self) -> float | None:
        """:func:`overlap_share` of these collectives."""
        return overlap_share(self.in_flight_s, self.exposed_s)


@dataclass(frozen=True)
class OverlapSummary(WithOverlapShare):
    """Totals over a set of spans (one direction, or both)."""

    collectives: int
    overlapped: int
    exposed_s: float
    in_flight_s: float


def summarize(spans: list[CollectiveSpan], direction: str | None = None) -> OverlapSummary:
    """Totals for ``direction`` (``fwd``/``bwd``) or, with ``None``, for both."""
    chosen = [s for s in spans if direction is None or s.direction == direction]
    return OverlapSummary(
        collectives=len(chosen),
        overlapped=sum(1 for s in chosen if s.overlapped_by),
        exposed_s=sum(s.exposed_s for s in chosen),
        in_flight_s=sum(s.in_flight_s for s in chosen),
    )
