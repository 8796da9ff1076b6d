"""Write a benchmark run's artefacts: ``latest.json``, a Markdown table and PNG plots.

The plots need matplotlib (the ``plot`` extra); without it the JSON and the table are still
written and the missing plots are named.
"""

from __future__ import annotations

import json
from pathlib import Path

from lab.bench.cover import cover_tables
from lab.bench.host_time import host_table
from lab.bench.metrics import DEEPSPEED, arm_names
from megatron_domino.tools.plots import pyplot, save

TABLE_HEADER = (
    "| case | setting | TP | p | k | link Mbit/s | T_base ms | T_dom ms | T_oracle ms | comm share "
    "| hidden | hidden fwd | hidden bwd | hidden over own floor | T_comm fwd / bwd ms (its CPU ms) "
    "| roofline eff. | roofline fwd | roofline bwd | speedup | chunk overhead "
    "| peak mem ratio |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
)


AUTO_HEADER = (
    "\n| case | auto chose | fastest measured | T_dom(choice) / T_dom(fastest) "
    "| tuner medians ms |\n|---|---|---|---|---|\n"
)


def _auto_table(cases: list[dict]) -> str:
    """``--domino-chunks auto``'s choice per case against the arms' fastest setting."""
    checked = [case for case in cases if case.get("auto")]
    if not checked:
        return ""
    lines = [AUTO_HEADER]
    for case in checked:
        auto = case["auto"]
        medians = ", ".join(f"{name} {s * 1e3:.0f}" for name, s in auto["medians_s"].items())
        lines.append(
            f"| {case['name']} | {auto['choice']} | {auto['fastest']} | {auto['ratio']:.3f} "
            f"| {medians} |\n"
        )
    return "".join(lines)


DEEPSPEED_HEADER = (
    "\n| case | setting | T_dom ms | T_deepspeed ms | T_dom / T_deepspeed | DeepSpeed chunk "
    "overhead | DeepSpeed roofline fwd / bwd |\n|---|---|---|---|---|---|---|\n"
)


def _deepspeed_table(cases: list[dict]) -> str:
    """Each setting against DeepSpeed-Domino's block in the same run (cases that ran it)."""
    lines = []
    for case in cases:
        rows = {row["setting"]: row for row in case["rows"]}
        deepspeed = rows.pop(DEEPSPEED, None)
        if deepspeed is None:
            continue
        ds_ms = deepspeed["arms"][arm_names(DEEPSPEED)[0]]["median_s"] * 1e3
        for setting, row in rows.items():
            dom_ms = row["arms"][arm_names(setting)[0]]["median_s"] * 1e3
            lines.append(
                f"| {case['name']} | {setting} | {dom_ms:.0f} | {ds_ms:.0f} "
                f"| {row['time_vs_deepspeed']:.3f} | {deepspeed['chunk_overhead']:.3f} "
                f"| {deepspeed['roofline_efficiency_fwd']:.0%} / "
                f"{deepspeed['roofline_efficiency_bwd']:.0%} |\n"
            )
    return DEEPSPEED_HEADER + "".join(lines) if lines else ""


def markdown_table(cases: list[dict]) -> str:
    lines = [TABLE_HEADER]
    for case in cases:
        for row in case["rows"]:
            arms = row["arms"]
            dom = arms[arm_names(row["setting"])[0]]["median_s"]
            link = "plain loopback" if case["link_mbit"] is None else f"{case['link_mbit']:.0f}"
            lines.append(
                f"| {case['name']} | {row['setting']} | {case['tensor_model_parallel_size']} "
                f"| {row['chunks']} | {row['column_chunks']} | {link} "
                f"| {arms['baseline']['median_s'] * 1e3:.0f} | {dom * 1e3:.0f} "
                f"| {arms['oracle']['median_s'] * 1e3:.0f} | {row['comm_share']:.0%} "
                f"| {row['hidden_fraction']:.0%} | {row['hidden_fraction_fwd']:.0%} "
                f"| {row['hidden_fraction_bwd']:.0%} | {row['hidden_over_own_floor']:.0%} "
                f"| {row['comm_only_fwd_s'] * 1e3:.0f} ({row['comm_only_cpu_fwd_s'] * 1e3:.0f}) / "
                f"{row['comm_only_bwd_s'] * 1e3:.0f} ({row['comm_only_cpu_bwd_s'] * 1e3:.0f}) "
                f"| {row['roofline_efficiency']:.0%} | {row['roofline_efficiency_fwd']:.0%} "
                f"| {row['roofline_efficiency_bwd']:.0%} | {row['speedup']:.3f} "
                f"| {row['chunk_overhead']:.3f} | {row['peak_mem_ratio']:.3f} |\n"
            )
    return (
        "".join(lines)
        + _waits_table(cases)
        + _link_cost(cases)
        + _deepspeed_table(cases)
        + _auto_table(cases)
        + _exposed_collectives(cases)
    )


WAITS_HEADER = (
    "\n| case | setting | comm share | blocked fwd ms (baseline) | blocked bwd ms (baseline) "
    "| floor fwd / bwd ms | roofline by waits fwd | roofline by waits bwd "
    "| peer wait fwd / bwd ms (baseline) |\n"
    "|---|---|---|---|---|---|---|---|---|\n"
)


def _waits_table(cases: list[dict]) -> str:
    """Emulated link: the time each setting's step was blocked in waits on the wire, per
    phase, against the baseline's and the floor no schedule goes below (metrics'
    ``roofline_by_waits``), and the time it waited for the other rank to launch; beside them the
    baseline's communication share the run measured (the regime they were judged in)."""
    lines = [
        f"| {case['name']} | {row['setting']} | {row['comm_share']:.1%} "
        f"| {row['blocked_fwd_s'] * 1e3:.0f} ({row['baseline_blocked_fwd_s'] * 1e3:.0f}) "
        f"| {row['blocked_bwd_s'] * 1e3:.0f} ({row['baseline_blocked_bwd_s'] * 1e3:.0f}) "
        f"| {row['blocked_floor_fwd_s'] * 1e3:.0f} / {row['blocked_floor_bwd_s'] * 1e3:.0f} "
        f"| {row['roofline_by_waits_fwd']:.0%} | {row['roofline_by_waits_bwd']:.0%} "
        f"| {row['peer_wait_fwd_s'] * 1e3:.0f} / {row['peer_wait_bwd_s'] * 1e3:.0f} "
        f"({row['baseline_peer_wait_fwd_s'] * 1e3:.0f} / "
        f"{row['baseline_peer_wait_bwd_s'] * 1e3:.0f}) |\n"
        for case in cases
        for row in case["rows"]
        if "blocked_fwd_s" in row
    ]
    return WAITS_HEADER + "".join(lines) if lines else ""


def _exposed_collectives(cases: list[dict]) -> str:
    """Emulated link: per case, arm and phase, which code's collectives the step waited for."""
    lines = []
    for case in cases:
        for arm, waits in (case.get("link_waits") or {}).items():
            for wait in sorted(waits, key=lambda w: (w["phase"], -w["blocked_ms"])):
                lines.append(
                    f"| {case['name']} | {arm} | {wait['phase']} | `{wait['caller']}` "
                    f"| {wait['kind']} | {wait['bytes']} | {wait['count']} "
                    f"| {wait['blocked_ms']:.1f} | {wait['peer_wait_ms']:.1f} |\n"
                )
    if not lines:
        return ""
    header = (
        "\nWhere one traced step waited on the emulated link (rank 0):\n\n"
        "| case | arm | phase | launched by | kind | bytes | count | blocked ms "
        "| peer wait ms |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    return header + "".join(lines)


def _link_cost(cases: list[dict]) -> str:
    """The emulated link's own CPU time against the wire time it modelled, per case."""
    lines = [
        f"\n{case['name']}: emulated link served {stats['collectives']} collectives, "
        f"{stats['wire_s']:.2f} s modelled on the wire for {stats['cpu_s']:.3f} s of its own CPU "
        f"({stats['cpu_per_wire']:.1%} of the wire time; "
        f"{stats['cpu_s'] / stats['collectives'] * 1e6:.0f} us per collective)\n"
        for case in cases
        if (stats := case.get("link_stats"))
    ]
    return "".join(lines)


def write_artefacts(out_dir: Path, run: dict) -> list[Path]:
    """Write ``latest.json``, ``table.md``, ``covers.md`` (what each collective of a traced
    step flew behind, :mod:`lab.bench.cover`) and plots into ``out_dir``; return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "latest.json", out_dir / "table.md", out_dir / "covers.md"]
    written[0].write_text(json.dumps(run, indent=1))
    written[1].write_text(markdown_table(run["cases"]) + host_table(run.get("host_time")))
    written[2].write_text(cover_tables(run))
    if pyplot("no plots written") is None:
        return written
    for case in run["cases"]:
        written.append(_plot_arms(out_dir / f"arms_{case['name']}.png", case))
        written.append(_plot_timeline(out_dir / f"timeline_{case['name']}.png", case))
        written.append(_plot_roofline(out_dir / f"roofline_{case['name']}.png", case))
    return written


def _plot_roofline(path: Path, case: dict) -> Path:
    """Per setting and phase: the hidden fraction next to the roofline efficiency."""
    import matplotlib.pyplot as plt

    rows = case["rows"]
    metrics = [
        ("hidden_fraction_fwd", "hidden fwd", "#e83"),
        ("roofline_efficiency_fwd", "roofline fwd", "#a40"),
        ("hidden_fraction_bwd", "hidden bwd", "#47c"),
        ("roofline_efficiency_bwd", "roofline bwd", "#137"),
    ]
    fig, ax = plt.subplots(figsize=(max(6, 1.5 * len(rows)), 4))
    width = 0.8 / len(metrics)
    for index, (key, label, color) in enumerate(metrics):
        ax.bar(
            [r + index * width for r in range(len(rows))],
            [row[key] for row in rows],
            width,
            label=label,
            color=color,
        )
    ax.set_xticks([r + 0.4 - width / 2 for r in range(len(rows))], [row["setting"] for row in rows])
    ax.axhline(1.0, color="#888", linewidth=0.8)
    ax.set_ylabel("fraction")
    ax.legend(fontsize="small")
    ax.set_title(f"{case['name']}: hidden fraction and roofline efficiency per phase")
    return save(fig, path)


def _plot_arms(path: Path, case: dict) -> Path:
    """Median iteration time per arm, with min-max spread."""
    import matplotlib.pyplot as plt

    arms = case["arms"]
    names = list(arms)
    medians = [arms[n]["total"]["median_s"] * 1e3 for n in names]
    low = [m - arms[n]["total"]["min_s"] * 1e3 for m, n in zip(medians, names, strict=True)]
    high = [arms[n]["total"]["max_s"] * 1e3 - m for m, n in zip(medians, names, strict=True)]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(names)), 4))
    ax.bar(
        range(len(names)),
        medians,
        yerr=[low, high],
        capsize=4,
        color=["#888" if n == "baseline" else "#4a4" if n == "oracle" else "#47c" for n in names],
    )
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylabel("iteration time, ms (median, min-max)")
    ax.set_title(
        f"{case['name']}: TP={case['tensor_model_parallel_size']}, "
        f"link {case['link_mbit'] or 'plain loopback'} Mbit/s"
    )
    return save(fig, path)


def _plot_timeline(path: Path, case: dict) -> Path:
    """One recorded step of the first Domino setting: compute regions per chunk, collectives."""
    import matplotlib.pyplot as plt

    setting = next(iter(case["timelines"]))
    events = case["timelines"][setting]
    fig, axes = plt.subplots(2, 1, figsize=(12, 5))
    for ax, direction in zip(axes, ("fwd", "bwd"), strict=True):
        chosen = [e for e in events if e["direction"] == direction]
        if not chosen:
            continue
        t0 = min(e["time_s"] for e in chosen)
        chunks = sorted({e["chunk"] for e in chosen})
        opened: dict[tuple, float] = {}
        for e in chosen:
            key = (e["name"], e["layer"], e["chunk"], e["piece"], e.get("collective"))
            t = (e["time_s"] - t0) * 1e3
            if e["kind"] in ("begin", "launch"):
                opened[(e["kind"],) + key] = t
            elif e["kind"] == "end" and ("begin",) + key in opened:
                start = opened.pop(("begin",) + key)
                ax.barh(e["chunk"], t - start, left=start, height=0.6, color="#47c", alpha=0.35)
            elif e["kind"] == "wait_end" and ("launch",) + key in opened:
                start = opened.pop(("launch",) + key)
                lane = len(chunks) + e["chunk"]
                ax.barh(lane, t - start, left=start, height=0.6, color="#e83", alpha=0.5)
        ax.set_yticks(
            range(2 * len(chunks)),
            [f"chunk {c} compute" for c in chunks] + [f"chunk {c} collectives" for c in chunks],
        )
        ax.set_xlabel(f"{'forward' if direction == 'fwd' else 'backward'} time, ms")
    fig.suptitle(
        f"{case['name']}, Domino {setting}: compute (blue) and collectives in flight (orange)"
    )
    return save(fig, path)
