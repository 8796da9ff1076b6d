"""``--domino-report``: record Domino's schedule on a few iterations and report the overlap.

The model chunks' Domino runtimes hold the :data:`~megatron_domino.recorder.NULL_RECORDER`
(free) on every other iteration. For a reported iteration one
:class:`~megatron_domino.recorder.EventRecorder` replaces it in every chunk's runtime for the
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
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from megatron_domino.analysis.report import report_lines, report_totals
from megatron_domino.analysis.spans import collective_spans
from megatron_domino.recorder import EventRecorder
from megatron_domino.state import DominoRuntime
from megatron_domino.training.domino_ab import DominoAB


class DominoOverlapReport:
    """Records and reports ``count`` iterations after the run's first (its warm-up).

    Args:
        runtimes: the Domino runtimes of this rank's model chunks; read when recording starts
            (the model is built after the report is created).
        count: how many iterations to record (``--domino-report-iters``).
        against_stock: the run's ``--domino-ab`` comparison (done before the report
            records), or ``None``.
    """

    def __init__(
        self,
        runtimes: Callable[[], list[DominoRuntime]],
        count: int,
        against_stock: DominoAB | None = None,
    ) -> None:
        self._runtimes = runtimes
        self._count = count
        self._against_stock = against_stock
        self._iterations: range | None = None
        self._recorded: dict[int, EventRecorder] = {}

    def _reported(self, iteration: int) -> bool:
        """Whether to record ``iteration``; the first call is the run's first step (fresh or
        resumed). A run of a single step reports that one: a report with warm-up beats none."""
        if self._iterations is None:
            from megatron.training import get_args

            last = get_args().train_iters
            if iteration >= last:
                self._iterations = range(iteration, last + 1)
            else:
                self._iterations = range(iteration + 1, min(iteration + self._count, last) + 1)
        return iteration in self._iterations

    @contextlib.contextmanager
    def recording(self, iteration: int) -> Iterator[None]:
        """Record the body (one optimizer step) if ``iteration`` is reported."""
        if not self._reported(iteration):
            yield
            return
        recorder = EventRecorder()
        runtimes = self._runtimes()
        previous = [runtime.recorder for runtime in runtimes]
        for runtime in runtimes:
            runtime.recorder = recorder
        try:
            yield
        finally:
            for runtime, recorder_before in zip(runtimes, previous, strict=True):
                runtime.recorder = recorder_before
        self._recorded[iteration] = recorder

    def report(self, iteration: int, write: Callable[[dict], None]) -> None:
        """Print the report of ``iteration``, if recorded, and ``write`` its totals."""
        recorder = self._recorded.pop(iteration, None)
        if recorder is None:
            return
        spans = collective_spans(recorder.events())
        clock = "CUDA events" if recorder.use_cuda_events else "wall clock"
        ab = self._against_stock if self._against_stock and self._against_stock.done else None
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
        if self._against_stock is None or not self._against_stock.done:
            return (
                "[domino-report] against stock: not timed in this run. The overlap share above "
                "is of Domino's own collectives, not a speed-up (the chunks cost time too): "
                "add --domino-ab N to time stock and Domino alternately in this run."
            )
        return (
            f"[domino-report] against stock (--domino-ab, this run): {self._against_stock.line()}"
        )
