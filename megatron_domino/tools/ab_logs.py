"""Reading a training run's log for the A/B report: ``--log-json`` records or Megatron-LM's
iteration lines (see :mod:`megatron_domino.tools.ab_report` for how both are used).
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from megatron_domino.training.runs import read_records

__all__ = ["ReportError", "Step", "default_warmup", "read_log", "summarize"]

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
    steps = _read_json(path) if first.lstrip().startswith("{") else _read_text(lines)
    if not steps:
        raise ReportError(
            f"{path}: no training iterations found (expected a --log-json file or the output "
            "of pretrain_gpt_domino.py with iteration lines)."
        )
    return sorted(steps, key=lambda step: step.iteration)


def _read_json(path: Path) -> list[Step]:
    try:
        records = read_records(path, "train")
    except ValueError as err:
        raise ReportError(str(err)) from err
    return [
        Step(
            iteration=int(record["iteration"]),
            seconds=float(record["seconds"]),
            tflops_per_gpu=None,
            loss=float(record["loss"]),
        )
        for record in records
    ]


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
