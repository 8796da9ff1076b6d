"""Write a benchmark run's artefacts: ``latest.json``, a Markdown table and PNG plots.

The plots need matplotlib (the ``plot`` extra); without it the JSON and the table are still
written and the missing plots are named.
"""

from __future__ import annotations

import json
from pathlib import Path

TABLE_HEADER = (
    "| case | setting | TP | p | k | link Mbit/s | T_base ms | T_dom ms | T_oracle ms | comm share "
    "| hidden | hidden fwd | hidden bwd | hidden over own floor | speedup | chunk overhead "
    "| peak mem ratio |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
)


def markdown_table(cases: list[dict]) -> str:
    lines = [TABLE_HEADER]
    for case in cases:
        for row in case["rows"]:
            arms = row["arms"]
            dom = arms[f"domino[{row['setting']}]"]["median_s"]
            link = "plain loopback" if case["link_mbit"] is None else f"{case['link_mbit']:.0f}"
            lines.append(
                f"| {case['name']} | {row['setting']} | {case['tensor_model_parallel_size']} "
                f"| {row['chunks']} | {row['column_chunks']} | {link} "
                f"| {arms['baseline']['median_s'] * 1e3:.0f} | {dom * 1e3:.0f} "
                f"| {arms['oracle']['median_s'] * 1e3:.0f} | {row['comm_share']:.0%} "
                f"| {row['hidden_fraction']:.0%} | {row['hidden_fraction_fwd']:.0%} "
                f"| {row['hidden_fraction_bwd']:.0%} | {row['hidden_over_own_floor']:.0%} "
                f"| {row['speedup']:.3f} "
                f"| {row['chunk_overhead']:.3f} | {row['peak_mem_ratio']:.3f} |\n"
            )
    return "".join(lines)


def write_artefacts(out_dir: Path, run: dict) -> list[Path]:
    """Write ``latest.json``, ``table.md`` and plots into ``out_dir``; return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "latest.json", out_dir / "table.md"]
    written[0].write_text(json.dumps(run, indent=1))
    written[1].write_text(markdown_table(run["cases"]))
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        print("matplotlib is not installed (pip install 'megatron-domino[plot]'): no plots written")
        return written
    for case in run["cases"]:
        written.append(_plot_arms(out_dir / f"arms_{case['name']}.png", case))
        written.append(_plot_timeline(out_dir / f"timeline_{case['name']}.png", case))
    return written


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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
