"""What each collective of one traced step flew behind: the per-collective cover table.

The bench records one step of each Domino setting with the event recorder (``timelines`` in
``latest.json``). Here that step's collectives of the layers' steady state (all layers but the
first and the last, where the model's two ends add their own) are grouped per direction,
collective and chunk: how long each flew (launch to end of wait), how long its wait blocked,
and what other chunks (or column pieces) computed between its launch and its wait, the
regions the recorder saw begin or end there (:mod:`megatron_domino.analysis.spans`). On the
emulated link a wait blocks while the wire still moves the collective, so *blocked* is the
part of its wire time the cover did not hide.

``python -m lab.bench.cover bench_results/latest.json`` prints the tables of every case and
setting; :func:`cover_tables` is what ``covers.md`` holds.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path

from megatron_domino.analysis.spans import CollectiveSpan, collective_spans
from megatron_domino.base.recorder import Event

__all__ = ["cover_rows", "cover_tables", "main"]

#: At most this many regions are named per cover (p = 4 lists three other chunks' ops).
_SHOWN = 6


def _steady(spans: list[CollectiveSpan]) -> list[CollectiveSpan]:
    layers = sorted({span.layer for span in spans})
    middle = layers[1:-1] if len(layers) > 2 else layers
    return [span for span in spans if span.layer in middle]


def _cover(span: CollectiveSpan) -> str:
    """``c1 attention_core, c1 attention_projection`` (regions in record order, each once)."""
    names = [
        f"c{chunk} {name}" + (f"[{piece}]" if piece else "")
        for name, _, chunk, piece in span.overlapped_by
    ]
    shown = ", ".join(names[:_SHOWN])
    return (shown + ", ...") if len(names) > _SHOWN else (shown or "nothing")


def cover_rows(events: list[dict]) -> list[dict]:
    """Per ``(direction, collective, chunk)`` of the steady-state layers: how many, median ms
    in flight and blocked, and the cover seen most often."""
    spans = _steady(collective_spans([Event(**event) for event in events]))
    groups: dict[tuple, list[CollectiveSpan]] = {}
    for span in spans:
        groups.setdefault((span.direction, span.name, span.chunk), []).append(span)
    rows = []
    for (direction, name, chunk), chosen in groups.items():
        cover, _ = Counter(_cover(span) for span in chosen).most_common(1)[0]
        rows.append(
            dict(
                direction=direction,
                collective=name,
                chunk=chunk,
                count=len(chosen),
                in_flight_ms=1e3 * statistics.median(s.in_flight_s for s in chosen),
                blocked_ms=1e3 * statistics.median(s.exposed_s for s in chosen),
                cover=cover,
            )
        )
    return sorted(rows, key=lambda r: (r["direction"] != "fwd", r["collective"], r["chunk"]))


_HEADER = (
    "| direction | collective | chunk | count | in flight ms | blocked ms | flew behind |\n"
    "|---|---|---|---|---|---|---|\n"
)


def cover_tables(run: dict) -> str:
    """Per case and setting with a traced step: its cover table (markdown)."""
    parts = []
    for case in run["cases"]:
        for setting, events in (case.get("timelines") or {}).items():
            rows = cover_rows(events)
            if not rows:
                continue
            lines = "".join(
                f"| {r['direction']} | {r['collective']} | {r['chunk']} | {r['count']} "
                f"| {r['in_flight_ms']:.1f} | {r['blocked_ms']:.1f} | {r['cover']} |\n"
                for r in rows
            )
            parts.append(f"\n{case['name']}, {setting} (steady-state layers):\n\n{_HEADER}{lines}")
    return "".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.bench.cover", description=__doc__)
    parser.add_argument("latest", type=Path, help="a bench run's latest.json")
    args = parser.parse_args(argv)
    print(cover_tables(json.loads(args.latest.read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
