"""Compare a baseline run and a ``--domino`` run: a Markdown table, a JSON file and a plot.

    python examples/ab_report.py --baseline A/log.jsonl --domino B/log.jsonl --gpus 8 \\
        --tokens-per-iteration 65536 --out-dir ab_results [--warmup N] [--meta key=value ...]

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

Writes ``table.md``, ``ab.json`` and, if matplotlib is installed, ``ab.png`` into ``--out-dir``.
Needs only the standard library (and matplotlib for the plot).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import platform
import re
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ARMS = ("baseline", "domino")

#: One iteration line of Megatron-LM's training loop (``training_log`` in
#: ``megatron/training/training.py``): `` iteration  N/ M | consumed samples: ... | elapsed time
#: per iteration (ms): ... | throughput per GPU (TFLOP/s/GPU): ... | ... | lm loss: ... |``.
TEXT_LINE = re.compile(
    r"\biteration\s+(?P<iteration>\d+)/\s*\d+ \|"
    r".*? elapsed time per iteration \(ms\): (?P<ms>[\d.]+) \|"
    r"(?: throughput per GPU \(TFLOP/s/GPU\): (?P<tflops>[-+\d.eE]+) \|)?"
    r".*? lm loss: (?P<loss>[-+\d.Ee]+|nan|inf) \|"
)


class ReportError(ValueError):
    """A log that cannot be compared; the message names the file and what is missing."""


@dataclass(frozen=True)
class Step:
    """One measured iteration (JSON log) or log interval (text log)."""

    iteration: int
    seconds: float
    tflops_per_gpu: float | None
    loss: float


def read_log(path: Path) -> list[Step]:
    """The training steps of a ``--log-json`` file or of a run's text output."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as err:
        raise ReportError(f"{path}: cannot read the log ({err.strerror}).") from err
    first = next((line for line in lines if line.strip()), "")
    steps = _read_json(path, lines) if first.lstrip().startswith("{") else _read_text(lines)
    if not steps:
        raise ReportError(
            f"{path}: no training iterations found (expected a --log-json file or the output "
            "of pretrain_gpt_domino.py with iteration lines)."
        )
    return sorted(steps, key=lambda step: step.iteration)


def _read_json(path: Path, lines: list[str]) -> list[Step]:
    steps = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ReportError(f"{path}:{number}: not a JSON object ({err.msg}).") from err
        if record.get("kind") == "train":
            steps.append(
                Step(
                    iteration=int(record["iteration"]),
                    seconds=float(record["seconds"]),
                    tflops_per_gpu=None,
                    loss=float(record["loss"]),
                )
            )
    return steps


def _read_text(lines: list[str]) -> list[Step]:
    steps = []
    for line in lines:
        match = TEXT_LINE.search(line)
        if match:
            tflops = match["tflops"]
            steps.append(
                Step(
                    iteration=int(match["iteration"]),
                    seconds=float(match["ms"]) / 1e3,
                    tflops_per_gpu=float(tflops) if tflops else None,
                    loss=float(match["loss"]),
                )
            )
    return steps


def tflop_per_gpu_iteration(path: Path, steps: list[Step]) -> float | None:
    """Model TFLOP per GPU in one iteration, from Megatron-LM's iteration lines: in ``steps``
    (a text log), else in ``train.log`` beside ``path`` (a ``--log-json`` file). ``None`` without
    ``--log-throughput``, or when its rounding (one decimal) leaves nothing: a CPU run's 0.0."""
    lines = [step for step in steps if step.tflops_per_gpu is not None]
    beside = path.with_name("train.log")
    if not lines and beside != path and beside.is_file():
        text = beside.read_text(encoding="utf-8", errors="replace").splitlines()
        lines = [step for step in _read_text(text) if step.tflops_per_gpu is not None]
    tflop = [step.tflops_per_gpu * step.seconds for step in lines]
    return statistics.median(tflop) if tflop and max(tflop) > 0 else None


def default_warmup(steps: list[Step]) -> int:
    """10 % of the iterations the log covers, at least one."""
    return max(1, (steps[-1].iteration - steps[0].iteration + 1) // 10)


def summarize(
    path: Path, steps: list[Step], *, warmup: int, gpus: int, tokens_per_iteration: int | None
) -> dict:
    """Median time and throughput of the steps after the first ``warmup`` iterations."""
    cutoff = steps[0].iteration - 1 + warmup
    measured = [step for step in steps if step.iteration > cutoff]
    if not measured:
        raise ReportError(
            f"{path}: all {len(steps)} logged iterations (up to {steps[-1].iteration}) fall in "
            f"the {warmup} warm-up iterations: train longer or pass a smaller --warmup."
        )
    seconds = [step.seconds for step in measured]
    median_s = statistics.median(seconds)
    summary = {
        "log": str(path),
        "iterations": [measured[0].iteration, measured[-1].iteration],
        "samples": len(measured),
        "ms_per_iteration": {
            "median": median_s * 1e3,
            "min": min(seconds) * 1e3,
            "max": max(seconds) * 1e3,
        },
        "tokens_per_s_per_gpu": None,
        "tflops_per_gpu": None,
        "losses": {str(step.iteration): step.loss for step in steps},
        "seconds": {str(step.iteration): step.seconds for step in steps},
    }
    # Tokens and FLOPs are the same every iteration (a fixed global batch).
    if tokens_per_iteration:
        summary["tokens_per_s_per_gpu"] = tokens_per_iteration / median_s / gpus
    tflop = tflop_per_gpu_iteration(path, steps)
    if tflop is not None:
        summary["tflops_per_gpu"] = tflop / median_s
    command = _command_beside(path)
    if command:
        summary["command"] = command
    return summary


def _command_beside(path: Path) -> str | None:
    """The launch command examples/lib/common.sh printed at the top of train.log, if any."""
    for candidate in (path, path.with_name("train.log")):
        try:
            with candidate.open(encoding="utf-8", errors="replace") as log:
                for line in log:
                    if "pretrain_gpt_domino.py" in line and not line.startswith("#"):
                        return line.strip()
        except OSError:
            continue
    return None


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


def provenance() -> dict:
    """Commit, versions and machine, recorded beside the numbers."""
    repo = Path(__file__).resolve().parent.parent
    info = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "commit": _run(["git", "-C", str(repo), "rev-parse", "HEAD"]),
        "uncommitted_changes": bool(_run(["git", "-C", str(repo), "status", "--porcelain"])),
        "gpu": None,
    }
    if shutil.which("nvidia-smi"):
        names = _run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
        info["gpu"] = names.splitlines()[0] if names else None
    for package in ("torch", "megatron-core", "megatron-domino"):
        try:
            info[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            info[package] = None
    return info


def _run(command: list[str]) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


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
    notes.append(
        f"Commit {machine['commit'] or 'unknown'}"
        f"{' (with uncommitted changes)' if machine['uncommitted_changes'] else ''}, "
        f"torch {machine['torch']}, megatron-core {machine['megatron-core']}, "
        f"host {machine['host']}, {machine['date']}."
    )
    return header + "".join(rows) + "\n".join(notes) + "\n"


def plot(path: Path, result: dict) -> Path | None:
    """Iteration times, throughput and loss of both arms; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plot written")
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
        print(f"ab_report.py: error: {err}", file=sys.stderr)
        return 1
    for path in write_report(args.out_dir, result):
        print(f"wrote {path}")
    print(markdown_table(result), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
