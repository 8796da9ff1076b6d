"""The bench's host-time row: per layer host time and dispatched aten ops, stock vs settings.

Host times on a shared CPU are noise at this size, so the test checks the plumbing (rows,
ratios, ``latest.json`` and the table) and the one number that is exact: the aten operators a
layer dispatches. A chunk runs the layer's operators again, so ``p`` chunks dispatch about
``p`` times stock's; what Domino adds beyond that (bookkeeping, copies) is bounded here, so a
regression that adds per-chunk operators fails it.
"""

from __future__ import annotations

import json

from lab.bench.host_time import host_table, measure_host_time
from lab.bench.report import write_artefacts

#: Dispatched operators per layer over stock's, at most (measured: 2.01, 4.02, 2.43, 2.04).
OPS_BOUND = {"p2": 2.1, "p4": 4.2, "p2-k2": 2.55, "s2": 2.15}


def test_host_row_measures_every_setting_and_lands_in_the_artefacts(tmp_path):
    host = measure_host_time(list(OPS_BOUND), iters=2, warmup=0)
    rows = {row["arm"]: row for row in host["rows"]}
    assert list(rows) == ["stock", *OPS_BOUND]
    assert rows["stock"]["host_vs_stock"] == rows["stock"]["ops_vs_stock"] == 1.0
    for name, bound in OPS_BOUND.items():
        chunks = int(name[1])
        assert chunks * 0.99 <= rows[name]["ops_vs_stock"] <= bound, (name, rows[name])
        assert rows[name]["host_ms"] > 0 and rows[name]["device_ms"] is None
    write_artefacts(tmp_path, {"commit": "test", "cases": [], "host_time": host})
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert [r["arm"] for r in latest["host_time"]["rows"]] == list(rows)
    table = (tmp_path / "table.md").read_text()
    assert table.endswith(host_table(host)) and "| p4 |" in table
