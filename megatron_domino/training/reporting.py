"""What a training run reports: log lines, one JSON record per step, TensorBoard, the summary.

Every rank computes the same numbers (losses are averaged over data-parallel ranks before they
get here), so only the rank built with ``enabled=True`` prints and writes. Log lines follow
Megatron-LM's layout and averaging: a line every ``--log-interval`` iterations, with the loss
and the time per iteration averaged over the iterations since the previous line. The JSON
file records every iteration and every evaluation unaveraged, so tests and benchmarks can
compare runs step by step (``--log-json``).

Throughput: tokens/s counts the tokens of the global batch (all ranks) per second of
iteration time; TFLOP/s/GPU divides Megatron-LM's model FLOPs (:mod:`.flops`) by the time
and the world size.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import asdict, dataclass, field

from megatron_domino.overlap_report import headline
from megatron_domino.training.flops import tflops_per_gpu


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step, as written to ``--log-json`` (``"kind": "train"``)."""

    iteration: int
    loss: float
    learning_rate: float
    grad_norm: float | None
    """Global L2 norm of the gradients before clipping; ``None`` when not computed."""
    seconds: float
    tokens_per_s: float
    tflops_per_gpu: float
    skipped: bool
    """True if the optimizer skipped the update (bf16/fp16 overflow)."""


@dataclass
class RunSummary:
    """What a finished run reports to its caller (tests, benchmarks, the demo)."""

    losses: dict[int, float] = field(default_factory=dict)
    """Training loss of every iteration run by this process, keyed by iteration."""
    validation_losses: dict[int, float] = field(default_factory=dict)
    tokens_per_s: float = math.nan
    """Median over the run's iterations, leaving out the first (warm-up) when there are more."""
    tflops_per_gpu: float = math.nan
    checkpoint: str | None = None
    """The last checkpoint written, if any."""
    log_json: str | None = None
    tensorboard_dir: str | None = None
    domino_report: dict | None = None
    """This rank's totals of the last ``--domino-report`` iteration (see
    :func:`megatron_domino.overlap_report.report_totals`), with its ``iteration``."""


class Reporter:
    """Formats and records the measurements of one run.

    Args:
        tokens_per_iteration: global batch size x sequence length.
        flops_per_iteration: Megatron-LM's FLOP count of one iteration.
        world_size: ranks sharing the iteration's FLOPs.
        train_iters: the final iteration, shown as ``iteration i/N``.
        log_interval: iterations per printed line.
        log_throughput: add tokens/s and TFLOP/s/GPU to printed lines.
        log_json: path of the JSON-lines file.
        resumed: the run continues a checkpoint, so ``log_json`` is appended to, not replaced.
        tensorboard_dir: TensorBoard log directory.
        enabled: False on every rank but the one that reports.
    """

    def __init__(
        self,
        *,
        tokens_per_iteration: int,
        flops_per_iteration: int,
        world_size: int,
        train_iters: int,
        log_interval: int,
        log_throughput: bool,
        log_json: str | None,
        resumed: bool,
        tensorboard_dir: str | None,
        enabled: bool,
    ) -> None:
        self._tokens = tokens_per_iteration
        self._flops = flops_per_iteration
        self._world_size = world_size
        self._train_iters = train_iters
        self._log_interval = log_interval
        self._log_throughput = log_throughput
        self._enabled = enabled
        self._pending: list[StepRecord] = []
        self._steps: list[StepRecord] = []
        self.summary = RunSummary(log_json=log_json, tensorboard_dir=tensorboard_dir)
        self._json = None
        if enabled and log_json:
            os.makedirs(os.path.dirname(os.path.abspath(log_json)), exist_ok=True)
            self._json = open(log_json, "a" if resumed else "w", encoding="utf-8")
        self._tensorboard = None
        if enabled and tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir=tensorboard_dir)

    def step(
        self,
        iteration: int,
        *,
        loss: float,
        learning_rate: float,
        grad_norm: float | None,
        seconds: float,
        skipped: bool,
    ) -> None:
        """Record one optimizer step; print a line when ``iteration`` ends a log interval."""
        record = StepRecord(
            iteration=iteration,
            loss=loss,
            learning_rate=learning_rate,
            grad_norm=grad_norm,
            seconds=seconds,
            tokens_per_s=self._tokens / seconds,
            tflops_per_gpu=tflops_per_gpu(self._flops, seconds, self._world_size),
            skipped=skipped,
        )
        self._steps.append(record)
        self._pending.append(record)
        self.summary.losses[iteration] = loss
        self._write_json({"kind": "train", **asdict(record)})
        if self._tensorboard is not None:
            for name, value in (
                ("lm loss", loss),
                ("learning-rate", learning_rate),
                ("grad-norm", grad_norm),
                ("iteration-time", seconds),
                ("throughput", record.tflops_per_gpu),
            ):
                if value is not None:
                    self._tensorboard.add_scalar(name, value, iteration)
        if iteration % self._log_interval == 0 or iteration == self._train_iters:
            self._print_interval()

    def _print_interval(self) -> None:
        steps, self._pending = self._pending, []
        seconds = sum(s.seconds for s in steps) / len(steps)
        last = steps[-1]
        line = (
            f" iteration {last.iteration:8d}/{self._train_iters:8d} |"
            f" elapsed time per iteration (ms): {seconds * 1e3:.1f} |"
        )
        if self._log_throughput:
            line += (
                f" tokens/s: {self._tokens / seconds:.0f} |"
                f" throughput per GPU (TFLOP/s/GPU): "
                f"{tflops_per_gpu(self._flops, seconds, self._world_size):.3g} |"
            )
        line += (
            f" learning rate: {last.learning_rate:.6E} |"
            f" lm loss: {statistics.fmean(s.loss for s in steps):.6E} |"
        )
        if last.grad_norm is not None:
            line += f" grad norm: {last.grad_norm:.3f} |"
        skipped = sum(s.skipped for s in steps)
        if skipped:
            line += f" skipped iterations: {skipped} |"
        self.print(line)

    def evaluation(self, iteration: int, loss: float) -> None:
        """Record and print the validation loss measured after ``iteration``."""
        self.summary.validation_losses[iteration] = loss
        self._write_json({"kind": "validation", "iteration": iteration, "loss": loss})
        if self._tensorboard is not None:
            self._tensorboard.add_scalar("validation loss", loss, iteration)
        self.print(
            f" validation loss at iteration {iteration} | lm loss: {loss:.6E} |"
            f" lm loss PPL: {math.exp(min(20.0, loss)):.6E} |"
        )

    def domino_report(self, iteration: int, *, lines: list[str], totals: dict) -> None:
        """Print one iteration's ``--domino-report`` and write its totals to ``--log-json``
        (``"kind": "domino_report"``, ``"iteration"``, then ``totals``)."""
        record = {"kind": "domino_report", "iteration": iteration, **totals}
        self.summary.domino_report = record
        self._write_json(record)
        for line in lines:
            self.print(line)

    def checkpoint_saved(self, iteration: int, path: str) -> None:
        self.summary.checkpoint = path
        self.print(f" saved checkpoint at iteration {iteration} to {path}")

    def print(self, line: str) -> None:
        """Print ``line`` on the reporting rank only."""
        if self._enabled:
            print(line, flush=True)

    def finish(self) -> RunSummary:
        """Close the files, print the run's summary and return it."""
        steady = self._steps[1:] or self._steps
        if steady:
            self.summary.tokens_per_s = statistics.median(s.tokens_per_s for s in steady)
            self.summary.tflops_per_gpu = statistics.median(s.tflops_per_gpu for s in steady)
        if self._json is not None:
            self._json.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        self.print(self._summary_text())
        return self.summary

    def _summary_text(self) -> str:
        summary = self.summary
        lines = ["", "Summary"]
        if summary.losses:
            first, last = min(summary.losses), max(summary.losses)
            lines.append(
                f"  loss: {summary.losses[first]:.4f} (iteration {first}) -> "
                f"{summary.losses[last]:.4f} (iteration {last})"
            )
            lines.append(
                f"  throughput: {summary.tokens_per_s:.0f} tokens/s, "
                f"{summary.tflops_per_gpu:.3g} TFLOP/s/GPU (median, warm-up iteration excluded)"
            )
        if summary.validation_losses:
            last = max(summary.validation_losses)
            lines.append(
                f"  validation loss: {summary.validation_losses[last]:.4f} (iteration {last})"
            )
        if summary.domino_report:
            lines.append(
                f"  Domino overlap (iteration {summary.domino_report['iteration']}): "
                f"{headline(summary.domino_report)}"
            )
        lines.append(f"  checkpoint: {summary.checkpoint or 'none (no --save)'}")
        lines.append(f"  JSON log: {summary.log_json or 'none (no --log-json)'}")
        if summary.tensorboard_dir:
            lines.append(f"  TensorBoard: {summary.tensorboard_dir}")
        return "\n".join(lines)

    def _write_json(self, record: dict) -> None:
        if self._json is not None:
            self._json.write(json.dumps(record) + "\n")
            self._json.flush()
