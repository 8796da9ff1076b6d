"""The benchmark pipeline on a tiny model: worker arms, derived metrics, JSON, table, plots.

This checks the plumbing and the fields of ``latest.json``; it measures nothing (the emulated
link at a fast rate, two iterations): speed claims come from ``make bench`` runs, not from
tests.
"""

from __future__ import annotations

import json
import math

from multiproc import run_on_ranks
from tiny_models import TINY

from lab.bench.metrics import ROW_FIELDS, auto_check, setting_rows
from lab.bench.report import write_artefacts
from megatron_domino.base.settings import setting

CASE = {
    "tensor_model_parallel_size": 2,
    "micro_batch_size": 4,
    "model": dict(num_layers=2, **TINY, num_attention_heads=4),
    "domino": {name: setting(name).fields for name in ("p2", "p1-k2")},
    "link": {"kind": "emulated", "mbit": 2000.0},
}


def _run_case() -> dict:
    from lab.bench.worker import run_case

    return run_case(CASE, iters=2, warmup=1)


def test_worker_metrics_and_artefacts(tmp_path):
    result = {"case": CASE, **run_on_ranks(_run_case, 2)[0]}
    expected_arms = {"baseline", "oracle", "comm_only[baseline]"} | {
        f"{kind}[{s}]" for kind in ("domino", "domino_noop", "comm_only") for s in CASE["domino"]
    }
    assert set(result["arms"]) == expected_arms
    for arm in result["arms"].values():
        for part in ("fwd", "bwd", "total"):
            assert arm[part]["min_s"] <= arm[part]["median_s"] <= arm[part]["max_s"]

    # The comm-only arm replays what each arm sent: p2 moves the baseline's bytes in two calls
    # where the baseline makes one per layer collective (2 per layer and phase), and per model
    # end (the embedding's in forward, the output layer's in backward).
    layer_collectives = 2 * CASE["model"]["num_layers"]
    for phase in ("fwd", "bwd"):
        base, p2 = result["collectives"]["baseline"][phase], result["collectives"]["p2"][phase]
        assert base["count"] > layer_collectives
        assert p2 == {"count": base["count"] + layer_collectives + 1, "bytes": base["bytes"]}

    # --domino-chunks auto picked one of the settings; the check compares it with the arms.
    auto = auto_check(result)
    assert auto["choice"] in CASE["domino"] and auto["fastest"] in CASE["domino"]
    assert set(auto["medians_s"]) == set(CASE["domino"]) and auto["ratio"] >= 1.0

    rows = setting_rows(result)
    assert [row["setting"] for row in rows] == ["p2", "p1-k2"]
    for row in rows:
        assert set(ROW_FIELDS) <= set(row)
        assert all(
            math.isfinite(row[f])
            for f in ("comm_share", "speedup", "chunk_overhead", "peak_mem_ratio")
        )
        assert row["comm_only_fwd_s"] > 0 and row["comm_only_bwd_s"] > 0
        assert 0 < row["comm_only_cpu_fwd_s"] and 0 < row["comm_only_cpu_bwd_s"]
    # Every arm's TP collectives went through the emulated link (none on gloo), at a cost.
    stats = result["link_stats"]
    assert stats["collectives"] > sum(
        calls[phase]["count"] for calls in result["collectives"].values() for phase in calls
    )
    assert stats["wire_s"] > 0 and stats["cpu_s"] > 0
    # ... and the step's waits on it were counted per phase and traced per launching code.
    for row in rows:
        for phase in ("fwd", "bwd"):
            assert row[f"baseline_blocked_{phase}_s"] > 0 and row[f"blocked_{phase}_s"] >= 0
            assert f"roofline_by_waits_{phase}" in row
    waits = result["link_waits"]
    assert set(waits) == {"baseline", "domino[p2]", "domino[p1-k2]"}
    assert any("RowParallelLinear" in w["caller"] for w in waits["baseline"])
    assert any("megatron_domino" in w["caller"] for w in waits["domino[p2]"])
    # Chunking keeps the same activations: the saved-for-backward bytes barely move.
    assert 0.9 < rows[0]["peak_mem_ratio"] < 1.2

    case = {
        "name": "tiny",
        "link_mbit": 2000.0,
        **CASE,
        "arms": result["arms"],
        "rows": rows,
        "timelines": result["timelines"],
        "peak_memory_bytes": result["peak_memory_bytes"],
        "collectives": result["collectives"],
        "comm_only_cpu_s": result["comm_only_cpu_s"],
        "auto": auto,
        "link_stats": result["link_stats"],
        "link_waits": result["link_waits"],
    }
    written = write_artefacts(tmp_path, {"commit": "test", "cases": [case]})
    latest = json.loads((tmp_path / "latest.json").read_text())
    assert latest["cases"][0]["rows"][0]["setting"] == "p2"
    table = (tmp_path / "table.md").read_text()
    assert "| tiny | p2 | 2 | 2 | 1 | 2000 |" in table
    assert "| tiny | p2 | " in table.split("roofline by waits bwd |")[1]
    assert "Where one traced step waited on the emulated link" in table
    assert f"tiny: emulated link served {result['link_stats']['collectives']} collectives" in table
    assert f"| tiny | {auto['choice']} | {auto['fastest']} | {auto['ratio']:.3f} |" in table
    covers = (tmp_path / "covers.md").read_text()
    assert "tiny, p2 (steady-state layers)" in covers and "| bwd | mlp_dgrad_ar | 1 |" in covers
    assert all(path.exists() for path in written)
