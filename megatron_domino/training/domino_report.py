"""``--domino-report``: record Domino's schedule on a few iterations and report the overlap.

The model's Domino runtime holds the :data:`~megatron_domino.recorder.NULL_RECORDER` (free)
on every other iteration. For a reported iteration an
:class:`~megatron_domino.recorder.EventRecorder` replaces it for the whole optimizer step
(every micro-batch's forward and backward), and the previous recorder is put back afterwards,
even if the step raised. This is ``apply_domino(..., recorder=...)`` for one step without
re-applying Domino: the patched modules read ``runtime.recorder`` during each forward, and a
backward uses the labels its forward created, so swapping between steps is safe.

Every rank records, so the ranks keep the same pace (a rank that did not record would reach
its waits earlier and distort the others' exposed times) and computes its own totals; rank 0
prints its report (:mod:`megatron_domino.overlap_report`) and writes its totals to
``--log-json``. The reported iterations pay for recording (a Python call per event, a CUDA
event on GPU), so their iteration times are slightly higher than the others'.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from megatron_domino.overlap import collective_spans
from megatron_domino.overlap_report import report_lines, report_totals
from megatron_domino.recorder import EventRecorder
from megatron_domino.state import DominoRuntime
from megatron_domino.training.reporting import Reporter


def reported_iterations(first_iteration: int, train_iters: int, count: int) -> range:
    """The ``count`` iterations after the run's first (its warm-up), within the run.

    A run of a single iteration reports that one: a report with warm-up costs beats none.
    """
    if first_iteration >= train_iters:
        return range(first_iteration, train_iters + 1)
    return range(first_iteration + 1, min(first_iteration + count, train_iters) + 1)


class DominoOverlapReport:
    """Records and reports the iterations in ``iterations`` on ``runtime``'s model.

    Args:
        runtime: the Domino runtime of the trained model (``apply_domino(...).runtime``).
        iterations: the iterations to record.
        reporter: prints the report (on rank 0) and writes its totals to ``--log-json``.
    """

    def __init__(self, runtime: DominoRuntime, iterations: range, reporter: Reporter) -> None:
        self._runtime = runtime
        self._iterations = iterations
        self._reporter = reporter
        self._recorded: dict[int, EventRecorder] = {}

    @contextlib.contextmanager
    def recording(self, iteration: int) -> Iterator[None]:
        """Record the body (one optimizer step) if ``iteration`` is reported."""
        if iteration not in self._iterations:
            yield
            return
        recorder = EventRecorder()
        previous, self._runtime.recorder = self._runtime.recorder, recorder
        try:
            yield
        finally:
            self._runtime.recorder = previous
        self._recorded[iteration] = recorder

    def report(self, iteration: int) -> None:
        """Print and log the report of ``iteration``, if it was recorded."""
        recorder = self._recorded.pop(iteration, None)
        if recorder is None:
            return
        spans = collective_spans(recorder.events())
        clock = "CUDA events" if recorder.use_cuda_events else "wall clock"
        self._reporter.domino_report(
            iteration,
            lines=report_lines(spans, iteration=iteration, clock=clock),
            totals={**report_totals(spans), "clock": clock},
        )
