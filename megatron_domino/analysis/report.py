"""The overlap report: from recorded collective spans to text lines and JSON totals.

Pure functions of :class:`~megatron_domino.analysis.spans.CollectiveSpan` lists, so they are tested
on synthetic spans without processes. The training loop (``--domino-report``) records a few
iterations with an :class:`~megatron_domino.base.recorder.EventRecorder` and prints
:func:`report_lines` after each.

For every layer and direction the report gives the collectives' *in-flight* time (launch to
end of wait), their *exposed* time (blocked in the wait) and the *overlap share*
``1 - exposed / in_flight`` (:func:`~megatron_domino.analysis.spans.overlap_share`). A collective whose ``overlapped_by`` is empty had no other
chunk's (or column piece's) compute between its launch and its wait: it hid nothing, and the
report warns about it, one ``WARNING:`` line per collective. The exceptions, by design of the
schedule: the last collective of each *pass* (one forward or one backward of one micro-batch,
see :func:`passes`), when nothing is left to compute, and the first waited of the model's
ends (chunk 0's embedding all-reduce, the last chunk's output-layer one), before which no
other chunk has anything to run. The ends get rows of their own, ``emb`` and ``head``.

Reading the overlap share: the in-flight time includes the other chunks' compute that ran
before the wait, so a collective that finished long before its wait counts as fully hidden.
The share says how much of the flight the caller was not blocked; it is an upper bound on
the share of the communication's own duration that was hidden (which the recorder cannot see:
it sees launches and waits, not when the wire went idle).
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass

from megatron_domino.analysis.criteria import first_wait_of_an_end
from megatron_domino.analysis.spans import (
    CollectiveSpan,
    OverlapSummary,
    WithOverlapShare,
    overlap_share,
    summarize,
)
from megatron_domino.communication.collectives import EMBEDDING_AR, HEAD_DGRAD_AR

DIRECTIONS = ("fwd", "bwd")
_DIRECTION_WORDS = {"fwd": "forward", "bwd": "backward"}


@dataclass(frozen=True)
class LayerRow(WithOverlapShare):
    """Totals of one layer's collectives in one direction (all chunks, pieces and passes);
    ``layer`` is the layer's number, or ``emb`` / ``head`` for the embedding's and the output
    layer's (:mod:`megatron_domino.engine.embedding_overlap`, :mod:`megatron_domino.engine.output_head`)."""

    layer: str
    direction: str
    collectives: int
    in_flight_s: float
    exposed_s: float


@dataclass(frozen=True)
class NotHidden:
    """A collective (one layer, direction, name, chunk and piece) that overlapped nothing.

    Attributes:
        passes: in how many passes of its direction it overlapped nothing.
        of_passes: how many passes of its direction were recorded.
    """

    layer: int
    direction: str
    name: str
    chunk: int
    piece: int
    passes: int
    of_passes: int


def passes(spans: list[CollectiveSpan]) -> list[list[CollectiveSpan]]:
    """Split ``spans`` (in launch order, as :func:`~megatron_domino.analysis.spans.collective_spans`
    returns them) into passes: maximal runs of one direction.

    Without pipeline parallelism Megatron-Core's schedule runs each micro-batch's forward,
    then its backward, so a step with ``m`` micro-batches has ``2 m`` passes.
    """
    runs: list[list[CollectiveSpan]] = []
    for span in spans:
        if runs and runs[-1][0].direction == span.direction:
            runs[-1].append(span)
        else:
            runs.append([span])
    return runs


def last_of_pass(run: list[CollectiveSpan]) -> CollectiveSpan:
    """The pass's last collective (the last to finish waiting): nothing is left to hide it."""
    return max(run, key=lambda s: s.wait_end_s)


def not_hidden(spans: list[CollectiveSpan]) -> list[NotHidden]:
    """Collectives with no overlapping compute, in launch order; excepted, by design: the last
    of each pass, and the first waited of the model's ends (chunk 0's embedding all-reduce, the
    last chunk's output-layer one: nothing of another chunk can run before them).

    The same collective (layer, direction, name, chunk, piece) in several passes (micro-batches)
    is listed once, with the number of passes it hid nothing in.
    """
    runs = passes(spans)
    of_passes = Counter(run[0].direction for run in runs)
    counts: Counter = Counter()
    for run in runs:
        exempt = last_of_pass(run)
        chunks = 1 + max(span.chunk for span in run)
        for span in run:
            if first_wait_of_an_end(span, chunks):
                continue
            if not span.overlapped_by and span is not exempt:
                counts[(span.layer, span.direction, span.name, span.chunk, span.piece)] += 1
    return [
        NotHidden(layer, direction, name, chunk, piece, count, of_passes[direction])
        for (layer, direction, name, chunk, piece), count in counts.items()
    ]


def _row_of(span: CollectiveSpan) -> tuple[int, str]:
    """Where a collective's row sorts and its label: the embedding's first, then the layers,
    the output layer's last."""
    if span.name == EMBEDDING_AR:
        return -1, "emb"
    if span.name == HEAD_DGRAD_AR:
        return sys.maxsize, "head"
    return span.layer, str(span.layer)


def layer_rows(spans: list[CollectiveSpan]) -> list[LayerRow]:
    """One row per layer (and model end) and direction that has collectives, by layer,
    forward first."""
    keys = sorted({(_row_of(s), DIRECTIONS.index(s.direction)) for s in spans})
    rows = []
    for row, direction_index in keys:
        direction = DIRECTIONS[direction_index]
        chosen = [s for s in spans if _row_of(s) == row and s.direction == direction]
        rows.append(
            LayerRow(
                layer=row[1],
                direction=direction,
                collectives=len(chosen),
                in_flight_s=sum(s.in_flight_s for s in chosen),
                exposed_s=sum(s.exposed_s for s in chosen),
            )
        )
    return rows


def _totals_record(summary: OverlapSummary) -> dict:
    return {
        "collectives": summary.collectives,
        "overlapped": summary.overlapped,
        "in_flight_s": summary.in_flight_s,
        "exposed_s": summary.exposed_s,
        "overlap_share": summary.overlap_share,
    }


def report_totals(spans: list[CollectiveSpan]) -> dict:
    """The report's totals as a JSON-ready dict: both directions, then ``fwd`` and ``bwd``.

    Keys: ``collectives``, ``overlapped`` (collectives with some overlapping compute),
    ``in_flight_s``, ``exposed_s``, ``overlap_share`` (``None`` with nothing in flight),
    ``passes``, ``not_hidden`` (collectives warned about), ``fwd`` and ``bwd`` (the first five
    keys per direction).
    """
    return {
        **_totals_record(summarize(spans)),
        "passes": len(passes(spans)),
        "not_hidden": sum(n.passes for n in not_hidden(spans)),
        **{d: _totals_record(summarize(spans, d)) for d in DIRECTIONS},
    }


def _percent(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{100 * fraction:.1f}%"


def headline(totals: dict) -> str:
    """One sentence from :func:`report_totals` (or its JSON record), e.g. ``73.2% of the
    in-flight time of 48 collectives overlapped compute (fwd 80.1%, bwd 66.0%)``."""
    parts = ", ".join(
        f"{d} {_percent(totals[d]['overlap_share'])}"
        for d in DIRECTIONS
        if totals[d]["collectives"]
    )
    return (
        f"{_percent(totals['overlap_share'])} of the in-flight time of "
        f"{totals['collectives']} collectives overlapped compute ({parts or 'none recorded'})"
    )


def _collective_words(name: str, chunk: int, piece: int, with_pieces: bool) -> str:
    return f"{name} chunk {chunk}" + (f" piece {piece}" if with_pieces else "")


def warning_lines(spans: list[CollectiveSpan]) -> list[str]:
    """One ``WARNING:`` line per collective that hid nothing (see :func:`not_hidden`)."""
    with_pieces = any(s.piece for s in spans)
    lines = []
    for item in not_hidden(spans):
        what = _collective_words(item.name, item.chunk, item.piece, with_pieces)
        other = "other chunk's or piece's" if with_pieces else "other chunk's"
        line = (
            f"WARNING: layer {item.layer} {item.direction} {what} hid nothing "
            f"(no {other} compute ran while it flew)"
        )
        if item.of_passes > 1:
            line += (
                f" in {item.passes} of {item.of_passes} {_DIRECTION_WORDS[item.direction]} passes"
            )
        lines.append(line)
    return lines


def report_lines(
    spans: list[CollectiveSpan], *, iteration: int, clock: str, rank: int
) -> list[str]:
    """The report of one iteration: a per-layer table, totals, then any warnings.

    Args:
        spans: the iteration's collectives, from :func:`~megatron_domino.analysis.spans.collective_spans`.
        iteration: shown in the title.
        clock: what the times measure, e.g. ``wall clock`` or ``CUDA events``.
        rank: the global rank whose collectives these are.
    """
    title = f"[domino-report] iteration {iteration} ({clock}, rank {rank})"
    if not spans:
        return [f"{title}: no Domino collectives were recorded"]
    totals = report_totals(spans)
    lines = [
        f"{title}: {headline(totals)}; {totals['passes']} passes",
        f"  {'layer':>5}  {'dir':<3}  {'collectives':>11}  {'in flight (ms)':>14}  "
        f"{'exposed (ms)':>12}  {'overlap':>7}",
    ]

    rows = [
        (r.layer, r.direction, r.collectives, r.in_flight_s, r.exposed_s) for r in layer_rows(spans)
    ]
    rows += [
        ("total", direction, t["collectives"], t["in_flight_s"], t["exposed_s"])
        for direction, t in [*((d, totals[d]) for d in DIRECTIONS), ("all", totals)]
        if t["collectives"]
    ]
    for label, direction, collectives, in_flight_s, exposed_s in rows:
        lines.append(
            f"  {label:>5}  {direction:<3}  {collectives:>11}  {in_flight_s * 1e3:>14.3f}  "
            f"{exposed_s * 1e3:>12.3f}  {_percent(overlap_share(in_flight_s, exposed_s)):>7}"
        )
    with_pieces = any(s.piece for s in spans)
    lonely_lasts = [s for s in map(last_of_pass, passes(spans)) if not s.overlapped_by]
    by_design = dict.fromkeys(
        f"layer {s.layer} {s.direction} {_collective_words(s.name, s.chunk, s.piece, with_pieces)}"
        for s in lonely_lasts
    )
    if by_design:
        lines.append(
            f"  (not warned: the last collective of each pass has nothing left to "
            f"overlap, by design: {', '.join(by_design)})"
        )
    if not totals["bwd"]["collectives"]:
        lines.append(
            "  (no backward collectives recorded: with --no-domino-backward-overlap "
            "Megatron-Core's own backward all-reduces run, unrecorded)"
        )
    lines += warning_lines(spans)
    return lines
