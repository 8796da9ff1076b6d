"""Compare a baseline run and a ``--domino`` run: a Markdown table, a JSON file and a plot.

    megatron-domino-ab-report --baseline A/log.jsonl --domino B/log.jsonl --gpus 8 \\
        --tokens-per-iteration 65536 --out-dir ab_results [--warmup N] [--meta key=value ...]

(also ``python -m megatron_domino.tools.ab_report``).

``examples/ab_compare.sh`` runs both arms and calls this; it also works on any two runs of
``pretrain_gpt_domino.py``. Each log is either

* the ``--log-json`` file (one JSON object per iteration, unaveraged; preferred), or
* the run's text output, whose iteration lines (Megatron-LM's own) average over
  ``--log-interval`` iterations; each line then counts as one sample.

The first ``--warmup`` iterations of each log are left out (default: 10 % of them, at least
one). ms/iteration is the median of the rest (with min and max as the spread). tokens/s/GPU
divides ``--tokens-per-iteration`` (global batch x sequence length) by that median time and the
GPUs. TFLOP/s/GPU divides the model FLOPs of one iteration by it: Megatron-LM's own count (its
GPT formula, ``num_floating_point_operations`` in ``megatron/training/training.py``), recovered
from the ``throughput per GPU (TFLOP/s/GPU)`` of its iteration lines (``--log-throughput``)
times their iteration time; for a ``--log-json`` file those lines are read from ``train.log``
beside it. Both use the same median time, so the speedup (baseline median / Domino median) is
also the throughput ratio.

The logs are read by :mod:`megatron_domino.tools.ab_logs`. Writes ``table.md``, ``ab.json`` (with :mod:`~megatron_domino.tools.provenance`) and, if
matplotlib is installed, ``ab.png`` into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_domino.tools.ab_logs import ReportError, default_warmup, read_log, summarize
from megatron_domino.tools.plots import pyplot, save
from megatron_domino.tools.provenance import describe, provenance

ARMS = ("baseline", "domino")


def loss_parity(baseline: dict, domino: dict) -> dict:
    """Largest loss difference over the iterations both logs have (same seed and data)."""
    common = sorted(set(baseline["losses"]) & set(domino["losses"]), key=int)
    diffs = [abs(baseline["losses"][i] - domino["losses"][i]) for i in common]
    return {
        "common_iterations": len(common),
        "max_abs_diff": max(diffs) if diffs else None,
        "final_iteration": int(common[-1]) if common else None,
        "final_baseline": baseline["losses"][common[-1]] if common else None,
        "final_domino": domino["losses"][common[-1]] if common else None,
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _digits(value: float | None) -> str:
    """One decimal for GPU-sized numbers, three significant digits for CPU smoke runs."""
    return ".1f" if value is not None and value >= 10 else ".3g"


def markdown_table(result: dict) -> str:
    """The A/B table (one row per arm) and the notes that say how to read it."""
    meta, machine = result["meta"], result["provenance"]
    system = meta.get("system") or machine.get("gpu") or machine["host"]
    header = (
        "| arm | system | GPUs | precision | model | seq length | micro / global batch | TP / PP "
        "| Domino | ms/iteration (median, min-max) | tokens/s/GPU | TFLOP/s/GPU | speedup |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for arm in ARMS:
        summary = result["arms"][arm]
        ms = summary["ms_per_iteration"]
        speedup = 1.0 if arm == "baseline" else result["speedup"]
        rows.append(
            f"| {arm} | {system} | {result['gpus']} | {meta.get('precision', '-')} "
            f"| {meta.get('model', '-')} | {meta.get('seq_length', '-')} "
            f"| {meta.get('micro_batch_size', '-')} / {meta.get('global_batch_size', '-')} "
            f"| {meta.get('tp', '-')} / {meta.get('pp', '-')} "
            f"| {meta.get('domino', '-') if arm == 'domino' else 'off'} "
            f"| {ms['median']:.1f} ({ms['min']:.1f}-{ms['max']:.1f}) "
            f"| {_fmt(summary['tokens_per_s_per_gpu'], ',.0f')} "
            f"| {_fmt(summary['tflops_per_gpu'], _digits(summary['tflops_per_gpu']))} "
            f"| {speedup:.3f} |\n"
        )
    base, parity = result["arms"]["baseline"], result["loss_parity"]
    notes = [
        "",
        f"Medians over iterations {base['iterations'][0]}-{base['iterations'][1]} of each run "
        f"({result['warmup_iterations']} warm-up iteration(s) left out). TFLOP/s/GPU: "
        "Megatron-LM's own model-FLOP count (--log-throughput), over the median time"
        + (
            "."
            if base["tflops_per_gpu"] is not None
            else "; '-': not in the logs, or rounded to 0.0 there (a CPU run)."
        ),
    ]
    if parity["max_abs_diff"] is not None:
        notes.append(
            f"Loss parity: max |loss difference| {parity['max_abs_diff']:.3g} over "
            f"{parity['common_iterations']} iterations; at iteration {parity['final_iteration']} "
            f"baseline {parity['final_baseline']:.4f}, Domino {parity['final_domino']:.4f}."
        )
    notes.append(
        "No 'no communication' arm: pretrain_gpt_domino.py cannot turn TP collectives into "
        "no-ops; `make bench` measures that upper bound on CPU."
    )
    notes.append(f"Provenance: {describe(machine)}.")
    return header + "".join(rows) + "\n".join(notes) + "\n"


def plot(path: Path, result: dict) -> Path | None:
    """Iteration times, throughput and loss of both arms; None without matplotlib."""
    plt = pyplot("no plot written")
    if plt is None:
        return None
    colors = {"baseline": "#888888", "domino": "#4477cc"}
    fig, (times, bars, losses) = plt.subplots(1, 3, figsize=(15, 4))
    for arm in ARMS:
        summary = result["arms"][arm]
        iterations = [int(i) for i in summary["seconds"]]
        times.plot(
            iterations,
            [s * 1e3 for s in summary["seconds"].values()],
            color=colors[arm],
            label=arm,
        )
        times.axhline(summary["ms_per_iteration"]["median"], color=colors[arm], ls="--", lw=1)
        losses.plot(
            iterations,
            list(summary["losses"].values()),
            color=colors[arm],
            ls="-" if arm == "baseline" else "--",
            label=arm,
        )
    first = min(int(i) for i in result["arms"]["baseline"]["seconds"])
    measured_from = result["arms"]["baseline"]["iterations"][0]
    if measured_from > first:
        times.axvspan(first - 0.5, measured_from - 0.5, color="#eeeeee", label="warm-up")
    times.set(xlabel="iteration", ylabel="ms per iteration", title="iteration time (--: median)")
    times.legend()
    metric = "tflops_per_gpu" if result["arms"]["baseline"]["tflops_per_gpu"] else None
    values = [
        result["arms"][arm][metric]
        if metric
        else 1e3 / result["arms"][arm]["ms_per_iteration"]["median"]
        for arm in ARMS
    ]
    bars.bar(ARMS, values, color=[colors[arm] for arm in ARMS])
    bars.set(
        ylabel="TFLOP/s/GPU (median)" if metric else "iterations/s (median)",
        title=f"speedup {result['speedup']:.3f}x",
    )
    losses.set(xlabel="iteration", ylabel="lm loss", title="loss parity")
    losses.legend()
    meta = result["meta"]
    fig.suptitle(
        f"{meta.get('model', '')} on {result['gpus']} GPUs, TP={meta.get('tp', '?')}, "
        f"Domino {meta.get('domino', '')}"
    )
    return save(fig, path)


def build_result(
    baseline: Path,
    domino: Path,
    *,
    gpus: int,
    warmup: int | None,
    meta: dict[str, str],
    tokens_per_iteration: int | None = None,
) -> dict:
    """Read both logs and compute everything the table, JSON and plot show."""
    paths = {"baseline": baseline, "domino": domino}
    steps = {arm: read_log(paths[arm]) for arm in ARMS}
    warmup = default_warmup(steps["baseline"]) if warmup is None else warmup
    arms = {
        arm: summarize(
            paths[arm],
            steps[arm],
            warmup=warmup,
            gpus=gpus,
            tokens_per_iteration=tokens_per_iteration,
        )
        for arm in ARMS
    }
    speedup = (
        arms["baseline"]["ms_per_iteration"]["median"]
        / arms["domino"]["ms_per_iteration"]["median"]
    )
    return {
        "meta": meta,
        "gpus": gpus,
        "tokens_per_iteration": tokens_per_iteration,
        "warmup_iterations": warmup,
        "speedup": speedup,
        "arms": arms,
        "loss_parity": loss_parity(arms["baseline"], arms["domino"]),
        "provenance": provenance(),
    }


def write_report(out_dir: Path, result: dict) -> list[Path]:
    """Write table.md, ab.json and ab.png (when matplotlib is there); return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "table.md", out_dir / "ab.json"]
    written[0].write_text(markdown_table(result), encoding="utf-8")
    written[1].write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    picture = plot(out_dir / "ab.png", result)
    return written + ([picture] if picture else [])


def _meta(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="megatron-domino-ab-report", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--baseline", type=Path, required=True, help="Log of the baseline run.")
    parser.add_argument("--domino", type=Path, required=True, help="Log of the --domino run.")
    parser.add_argument(
        "--gpus", type=int, required=True, help="Ranks (GPUs) of each run, for tokens/s/GPU."
    )
    parser.add_argument(
        "--tokens-per-iteration",
        type=int,
        default=None,
        metavar="N",
        help="Tokens of one iteration (global batch x sequence length), for tokens/s/GPU. "
        "Without it that column is empty.",
    )
    parser.add_argument(
        "--out-dir", type=Path, default=Path("ab_results"), help="Default: ab_results."
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="Iterations left out at the start of each log. Default: 10 %% of them, at least 1.",
    )
    parser.add_argument(
        "--meta",
        type=_meta,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Run description for the table: system, model, precision, seq_length, "
        "micro_batch_size, global_batch_size, tp, pp, domino (any other key goes to ab.json).",
    )
    args = parser.parse_args(argv)
    if args.gpus < 1 or (args.warmup is not None and args.warmup < 0):
        parser.error("--gpus must be >= 1 and --warmup >= 0.")
    if args.tokens_per_iteration is not None and args.tokens_per_iteration < 1:
        parser.error("--tokens-per-iteration must be >= 1.")
    try:
        result = build_result(
            args.baseline,
            args.domino,
            gpus=args.gpus,
            warmup=args.warmup,
            meta=dict(args.meta),
            tokens_per_iteration=args.tokens_per_iteration,
        )
    except ReportError as err:
        print(f"megatron-domino-ab-report: error: {err}", file=sys.stderr)
        return 1
    for path in write_report(args.out_dir, result):
        print(f"wrote {path}")
    print(markdown_table(result), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
