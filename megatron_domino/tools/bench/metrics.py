"""The benchmark's derived numbers, from one case's arm timings (see docs/domino.md sec. 6).

With ``T_base`` (unpatched), ``T_dom`` (Domino), ``T_oracle`` (no TP communication) and
``T_noop`` (Domino with no-op collectives), all medians of the same work:

* ``comm_share = 1 - T_oracle / T_base``
* ``hidden_fraction = (T_base - T_dom) / (T_base - T_oracle)`` (also forward/backward alone)
* ``hidden_over_own_floor = 1 - (T_dom - T_noop) / (T_base - T_oracle)``: the share of the
  baseline's communication time that Domino does not expose above its *own* no-communication
  time. It separates hiding from what chunking itself costs or saves: the sequence split,
  for one, skips the masked upper triangle of causal attention, so ``T_noop < T_oracle``
  there and ``hidden_fraction`` alone would count that compute saving as hidden
  communication.
* ``speedup = T_base / T_dom``
* ``chunk_overhead = T_noop / T_oracle``
* ``peak_mem_ratio`` = Domino's peak memory over the baseline's
"""

from __future__ import annotations

#: Fields every per-setting row of ``latest.json`` carries (tests check them).
ROW_FIELDS = (
    "setting",
    "chunks",
    "column_chunks",
    "comm_share",
    "hidden_fraction",
    "hidden_fraction_fwd",
    "hidden_fraction_bwd",
    "hidden_over_own_floor",
    "speedup",
    "chunk_overhead",
    "peak_mem_ratio",
    "arms",
    "recorder_overlapped_fraction_fwd",
    "recorder_overlapped_fraction_bwd",
)


def _median(arms: dict, arm: str, part: str = "total") -> float:
    return arms[arm][part]["median_s"]


def _hidden(arms: dict, domino_arm: str, part: str) -> float:
    base, oracle = _median(arms, "baseline", part), _median(arms, "oracle", part)
    return (
        (base - _median(arms, domino_arm, part)) / (base - oracle)
        if base > oracle
        else float("nan")
    )


def setting_rows(result: dict) -> list[dict]:
    """One row per Domino setting of a case result written by the bench worker."""
    arms, case = result["arms"], result["case"]
    rows = []
    for setting, domino in case["domino"].items():
        arm, noop = f"domino[{setting}]", f"domino_noop[{setting}]"
        overlap = result["recorder_overlap"][setting]
        rows.append(
            {
                "setting": setting,
                "chunks": domino.get("chunks", 2),
                "column_chunks": domino.get("column_chunks", 1),
                "split_along": domino.get("split_along", "batch"),
                "comm_share": 1 - _median(arms, "oracle") / _median(arms, "baseline"),
                "hidden_fraction": _hidden(arms, arm, "total"),
                "hidden_fraction_fwd": _hidden(arms, arm, "fwd"),
                "hidden_fraction_bwd": _hidden(arms, arm, "bwd"),
                "hidden_over_own_floor": 1
                - (_median(arms, arm) - _median(arms, noop))
                / (_median(arms, "baseline") - _median(arms, "oracle")),
                "speedup": _median(arms, "baseline") / _median(arms, arm),
                "chunk_overhead": _median(arms, noop) / _median(arms, "oracle"),
                "peak_mem_ratio": result["peak_memory_bytes"][arm]
                / result["peak_memory_bytes"]["baseline"],
                "arms": {name: arms[name]["total"] for name in ("baseline", "oracle", arm, noop)},
                "recorder_overlapped_fraction_fwd": _overlapped(overlap["fwd"]),
                "recorder_overlapped_fraction_bwd": _overlapped(overlap["bwd"]),
            }
        )
    return rows


def _overlapped(summary: dict) -> float:
    """Share of the collectives' in-flight time the caller did not spend blocked in a wait."""
    flight = summary["in_flight_s"]
    return 1 - summary["exposed_s"] / flight if flight > 0 else float("nan")
