"""The benchmark's derived numbers, from one case's arm timings (see the project's notes,
``../shared/docs/domino.md`` beside the checkout, sec. 6).

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
* ``roofline_efficiency = (T_base - T_dom) / (T_base - max(T_noop, T_comm))`` per phase
  (``_fwd``, ``_bwd``; the total's bound is the sum of the phases' bounds), where ``T_comm``
  is the comm-only arm of the setting: its collectives alone
  (:mod:`lab.bench.comm_only`). 1 is as much as any schedule of these
  collectives could hide; unlike ``hidden_fraction`` it does not ask the impossible where a
  phase's communication outlasts its compute. ``comm_only_cpu_*_s`` is the CPU time a rank
  spends on those collectives (gloo's threads included): where compute already keeps every
  core busy, as on this CPU testbed, that time cannot overlap anything.
* on the emulated link (:mod:`lab.bench.emulated_link`) also
  ``blocked_fwd_s`` / ``blocked_bwd_s``: the seconds Domino's step spent blocked in waits
  once both ranks had launched (the least-blocked rank's, see the worker's ``_timed_step``),
  ``B_dom``, and the baseline's ``B_base``
  (``peer_wait_*_s``: blocked before the other rank launched, the ranks out of step); and
  ``roofline_by_waits = (B_base - B_dom) / (B_base - max(0, T_comm - T_noop))`` per phase:
  the roofline efficiency with the exposed communication read off the waits instead of
  from differences of wall-time medians (a perfect schedule still waits where the phase's
  communication outlasts its compute). The link's waits are sleeps of modelled length, so
  this is far less noisy than ``roofline_efficiency`` on shared cores; it leaves out what
  the testbed adds to compute (the link's own CPU time, reported apart, and cache effects).
* ``speedup = T_base / T_dom``; ``time_vs_deepspeed = T_dom / T_ds`` where the case ran
  DeepSpeed-Domino (its row has the same metrics, from its own no-op and comm-only arms)
* ``chunk_overhead = T_noop / T_oracle``
* ``peak_mem_ratio`` = Domino's peak memory over the baseline's
* ``recorder_overlap_share_fwd`` / ``_bwd``: the recorder's overlap share of one traced
  Domino step (:func:`~megatron_domino.analysis.spans.overlap_share`, from launches and
  waits), a different number from ``hidden_fraction`` (from step times)
"""

from __future__ import annotations

from megatron_domino.analysis.spans import overlap_share

#: The row of DeepSpeed's own Domino (``deepspeed.runtime.domino``), where a case runs it.
DEEPSPEED = "deepspeed"

#: Fields every per-setting row of ``latest.json`` carries (tests check them).
ROW_FIELDS = (
    "setting",
    "implementation",
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
    "comm_only_fwd_s",
    "comm_only_bwd_s",
    "comm_only_cpu_fwd_s",
    "comm_only_cpu_bwd_s",
    "roofline_efficiency",
    "roofline_efficiency_fwd",
    "roofline_efficiency_bwd",
    "collectives",
    "arms",
    "recorder_overlap_share_fwd",
    "recorder_overlap_share_bwd",
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


def comm_only_arm(name: str) -> str:
    """The comm-only arm of ``baseline``, a Domino setting or ``deepspeed``."""
    return f"comm_only[{name}]"


def arm_names(setting: str) -> tuple[str, str, str]:
    """The (with communication, no-op, comm-only) arms of a row: a Domino setting's, or
    DeepSpeed-Domino's for the row named :data:`DEEPSPEED`. The worker names its arms with it."""
    if setting == DEEPSPEED:
        return DEEPSPEED, f"{DEEPSPEED}_noop", comm_only_arm(DEEPSPEED)
    return f"domino[{setting}]", f"domino_noop[{setting}]", comm_only_arm(setting)


def _roofline(arms: dict, setting: str, part: str) -> float:
    """``(T_base - T_dom) / (T_base - bound)`` where the bound is ``max(T_noop, T_comm)`` per
    phase, summed over the phases ``part`` covers."""
    arm, noop, comm = arm_names(setting)
    phases = ("fwd", "bwd") if part == "total" else (part,)
    bound = sum(max(_median(arms, noop, phase), _median(arms, comm, phase)) for phase in phases)
    base = _median(arms, "baseline", part)
    return (base - _median(arms, arm, part)) / (base - bound) if base > bound else float("nan")


def _by_waits(arms: dict, setting: str) -> dict:
    """The emulated link's blocked-time fields of a row (module docstring); none elsewhere."""
    arm, noop, comm = arm_names(setting)
    if "blocked_fwd" not in arms[arm]:
        return {}
    fields = {}
    for phase in ("fwd", "bwd"):
        base = _median(arms, "baseline", f"blocked_{phase}")
        dom = _median(arms, arm, f"blocked_{phase}")
        floor = max(0.0, _median(arms, comm, phase) - _median(arms, noop, phase))
        fields[f"baseline_blocked_{phase}_s"] = base
        fields[f"blocked_{phase}_s"] = dom
        fields[f"baseline_peer_wait_{phase}_s"] = _median(arms, "baseline", f"peer_wait_{phase}")
        fields[f"peer_wait_{phase}_s"] = _median(arms, arm, f"peer_wait_{phase}")
        fields[f"blocked_floor_{phase}_s"] = floor
        fields[f"roofline_by_waits_{phase}"] = (
            (base - dom) / (base - floor) if base > floor else float("nan")
        )
    return fields


def _row(result: dict, setting: str, domino: dict) -> dict:
    arms = result["arms"]
    arm, noop, comm = arm_names(setting)
    overlap = result["recorder_overlap"].get(setting)
    base, oracle = _median(arms, "baseline"), _median(arms, "oracle")
    row = {
        "setting": setting,
        "implementation": DEEPSPEED if setting == DEEPSPEED else "megatron-domino",
        "chunks": domino.get("chunks", 2),
        "column_chunks": domino.get("column_chunks", 1),
        "split_along": domino.get("split_along", "batch"),
        "comm_share": 1 - oracle / base,
        "hidden_fraction": _hidden(arms, arm, "total"),
        "hidden_fraction_fwd": _hidden(arms, arm, "fwd"),
        "hidden_fraction_bwd": _hidden(arms, arm, "bwd"),
        "hidden_over_own_floor": 1 - (_median(arms, arm) - _median(arms, noop)) / (base - oracle),
        "speedup": base / _median(arms, arm),
        "chunk_overhead": _median(arms, noop) / oracle,
        "peak_mem_ratio": result["peak_memory_bytes"][arm]
        / result["peak_memory_bytes"]["baseline"],
        "comm_only_fwd_s": _median(arms, comm, "fwd"),
        "comm_only_bwd_s": _median(arms, comm, "bwd"),
        "comm_only_cpu_fwd_s": result["comm_only_cpu_s"][setting]["fwd"],
        "comm_only_cpu_bwd_s": result["comm_only_cpu_s"][setting]["bwd"],
        "roofline_efficiency": _roofline(arms, setting, "total"),
        "roofline_efficiency_fwd": _roofline(arms, setting, "fwd"),
        "roofline_efficiency_bwd": _roofline(arms, setting, "bwd"),
        "collectives": result["collectives"][setting],
        "arms": {name: arms[name]["total"] for name in ("baseline", "oracle", arm, noop, comm)},
        "recorder_overlap_share_fwd": _recorder_share(overlap, "fwd"),
        "recorder_overlap_share_bwd": _recorder_share(overlap, "bwd"),
    }
    row |= _by_waits(arms, setting)
    if DEEPSPEED in arms:
        row["time_vs_deepspeed"] = _median(arms, arm) / _median(arms, DEEPSPEED)
    return row


def setting_rows(result: dict) -> list[dict]:
    """One row per Domino setting of a case result written by the bench worker, and one for
    DeepSpeed-Domino (setting ``deepspeed``: p = 2, batch split) where the case ran it."""
    rows = [_row(result, setting, domino) for setting, domino in result["case"]["domino"].items()]
    if DEEPSPEED in result["arms"]:
        rows.append(_row(result, DEEPSPEED, {"chunks": 2}))
    return rows


def _recorder_share(overlap: dict | None, direction: str) -> float | None:
    """The recorder's :func:`~megatron_domino.analysis.spans.overlap_share` of one direction
    of a traced Domino step (``None`` without a trace or with nothing in flight)."""
    if not overlap:
        return None
    return overlap_share(overlap[direction]["in_flight_s"], overlap[direction]["exposed_s"])


def auto_check(result: dict) -> dict | None:
    """``--domino-chunks auto``'s choice against the fastest setting by the arms' medians:
    ``ratio`` is ``T_dom(choice) / T_dom(fastest)`` (1 when it picked the fastest)."""
    auto = result.get("auto")
    if auto is None:
        return None
    arms = result["arms"]
    medians = {
        setting: _median(arms, arm_names(setting)[0]) for setting in result["case"]["domino"]
    }
    fastest = min(medians, key=medians.get)
    ratio = medians[auto["choice"]] / medians[fastest]
    return {**auto, "fastest": fastest, "ratio": ratio, "within_2pct": ratio <= 1.02}
