"""``--domino-report``: record Domino's schedule on a few iterations and report the overlap.

The model chunks' Domino runtimes hold the :data:`~megatron_domino.base.recorder.NULL_RECORDER`
(free) on every other iteration. For a reported iteration one
:class:`~megatron_domino.base.recorder.EventRecorder` replaces it in every chunk's runtime for the
whole optimizer step (every micro-batch's forward and backward), and the previous recorder is
put back afterwards, even if the step raised. This is ``apply_domino(..., recorder=...)`` for
one step without re-applying Domino: the patched modules read ``runtime.recorder`` during each
forward, and a backward uses the labels its forward created, so swapping between steps is safe.

Every rank records, so the ranks keep the same pace (a rank that did not record would reach
its waits earlier and distort the others' exposed times) and computes its own totals; the last
rank (the one that writes ``--log-json``) prints its report
(:mod:`megatron_domino.analysis.report`) and writes its totals as
``{"kind": "domino_report", "iteration", ...}``. The reported iterations pay for recording
(a Python call per event, a CUDA event on GPU), so their times are slightly higher.

The overlap share is of Domino's own collectives' flight: it says nothing about whether the
run is faster than stock (a run can hide 40 % and still be slower, the chunks costing more
than the waits they remove). So each report ends with a line *against stock*: with
``--domino-ab`` the comparison's result (stock's and Domino's step time and exposed TP wait,
Domino's chunking cost; the report then records after it), and without it a line that says
no stock reference was timed and how to get one; the ``domino_report`` record carries the
same as ``against_stock`` (``None`` without ``--domino-ab``).

This module owns the flag: its arguments (:func:`add_domino_report_args`), their checks
(:func:`domino_report_problems`), the report built from them
(:meth:`DominoOverlapReport.from_args`) and its one call per iteration
(:meth:`DominoOverlapReport.reporting`, around the loop's step).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from megatron_domino.training.domino_ab import DominoAB

if TYPE_CHECKING:
    from megatron_domino.base.recorder import EventRecorder
    from megatron_domino.engine.state import DominoRuntime

__all__ = [
    "DominoOverlapReport",
    "add_domino_report_args",
    "domino_report_problems",
    "steps_after_comparison",
]


def add_domino_report_args(group: argparse._ArgumentGroup) -> None:
    """``--domino-report`` and ``--domino-report-iters`` (flags of this project's entry points,
    not Megatron-LM's), into the loop hooks' argument ``group``."""
    group.add_argument(
        "--domino-report",
        action="store_true",
        help="With --domino: record the collectives of a few iterations after the first and "
        "print, per layer and direction, their in-flight and exposed time and overlap share; "
        "totals go to --log-json. With --domino-ab it records after the comparison and ends "
        "with its stock-vs-Domino numbers (overlap is not a speed-up by itself).",
    )
    group.add_argument(
        "--domino-report-iters",
        type=int,
        default=3,
        metavar="N",
        help="How many iterations --domino-report records. Default: 3.",
    )


def domino_report_problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with the report's flags (empty when nothing), at argument time."""
    problems = []
    if args.domino_report and not args.domino:
        problems.append("--domino-report reports Domino's overlap; add --domino.")
    if args.domino_report_iters < 1:
        problems.append(f"--domino-report-iters must be >= 1, got {args.domino_report_iters}.")
    return problems


def steps_after_comparison(args: argparse.Namespace) -> int:
    """Training iterations the report needs after a ``--domino-ab`` comparison (it records
    after it, the first of them a warm-up), 0 without ``--domino-report``."""
    return args.domino_report_iters + 1 if args.domino_report else 0


@dataclass(eq=False)
class DominoOverlapReport:
    """Records and reports ``count`` iterations after the run's first (its warm-up).

    Attributes:
        runtimes: the Domino runtimes of this rank's model chunks; read when recording starts
            (the model is built after the report is created).
        count: how many iterations to record (``--domino-report-iters``).
        train_iters: the run's last iteration, read at its first step (Megatron-LM derives
            ``args.train_iters`` from ``--train-samples`` inside ``pretrain()``).
        against_stock: the run's ``--domino-ab`` comparison (done before the report
            records), or ``None``.
    """

    runtimes: Callable[[], list[DominoRuntime]]
    count: int
    train_iters: Callable[[], int]
    against_stock: DominoAB | None = None
    _iterations: range | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, domino_hook, against_stock: DominoAB | None
    ) -> DominoOverlapReport | None:
        """The report ``args`` ask for on the model chunks of ``domino_hook`` (Domino's model
        hook, or ``None`` without ``--domino``), or ``None``."""
        if domino_hook is None or not args.domino_report:
            return None
        return cls(
            lambda: [handle.runtime for handle in domino_hook.handles],
            args.domino_report_iters,
            lambda: args.train_iters,
            against_stock=against_stock,
        )

    def _reported(self, iteration: int) -> bool:
        """Whether to record ``iteration``; the first call is the run's first step (fresh or
        resumed). A run of a single step reports that one: a report with warm-up beats none."""
        if self._iterations is None:
            last = self.train_iters()
            if iteration >= last:
                self._iterations = range(iteration, last + 1)
            else:
                self._iterations = range(iteration + 1, min(iteration + self.count, last) + 1)
        return iteration in self._iterations

    @contextlib.contextmanager
    def reporting(self, iteration: int, write: Callable[[dict], None]) -> Iterator[None]:
        """Around the body (one optimizer step, and what the loop writes of it): if
        ``iteration`` is reported, record it, then print its report and ``write`` its totals.
        A step that raises is neither reported nor left recording."""
        if not self._reported(iteration):
            yield
            return
        # Imported here, as the report's other library modules: the flags above are parsed
        # on runs without --domino too, which import none of the library.
        from megatron_domino.base.recorder import EventRecorder

        recorder = EventRecorder()
        runtimes = self.runtimes()
        previous = [runtime.recorder for runtime in runtimes]
        for runtime in runtimes:
            runtime.recorder = recorder
        try:
            yield
        finally:
            for runtime, recorder_before in zip(runtimes, previous, strict=True):
                runtime.recorder = recorder_before
        self._report(iteration, recorder, write)

    def _report(
        self, iteration: int, recorder: EventRecorder, write: Callable[[dict], None]
    ) -> None:
        from megatron_domino.analysis.report import report_lines, report_totals
        from megatron_domino.analysis.spans import collective_spans

        spans = collective_spans(recorder.events())
        clock = "CUDA events" if recorder.use_cuda_events else "wall clock"
        ab = self.against_stock if self.against_stock and self.against_stock.done else None
        write(
            {
                "kind": "domino_report",
                "iteration": iteration,
                **report_totals(spans),
                "clock": clock,
                "against_stock": ab.record_dict() if ab else None,
            }
        )
        rank = torch.distributed.get_rank()
        if rank == torch.distributed.get_world_size() - 1:
            lines = report_lines(spans, iteration=iteration, clock=clock, rank=rank)
            print("\n".join([*lines, self.against_stock_line()]), flush=True)

    def against_stock_line(self) -> str:
        """The report's last line: how the run compares with stock, or that it was not timed
        (no ``--domino-ab``, or a resumed run too short for it)."""
        if self.against_stock is None or not self.against_stock.done:
            return (
                "[domino-report] against stock: not timed in this run. The overlap share above "
                "is of Domino's own collectives, not a speed-up (the chunks cost time too): "
                "add --domino-ab N to time stock and Domino alternately in this run."
            )
        return f"[domino-report] against stock (--domino-ab, this run): {self.against_stock.line()}"
