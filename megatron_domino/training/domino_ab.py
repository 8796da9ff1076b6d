"""``--domino-ab N``: stock and Domino timed alternately on the run's own optimizer steps.

A separate baseline run answers "did Domino help?" only as well as two jobs on the same
cluster resemble each other (other jobs, node placement, clocks). Inside one run the two arms
share all of that: :class:`DominoAB` is a small state machine fed one step at a time that
runs the run's first step with Domino (everyone's warm-up), one stock step (stock's warm-up),
then ``N`` Domino and ``N`` stock steps alternately, and Domino from then on. The loop
(:mod:`.loop_hooks`) reverts and re-applies Domino between optimizer steps as
``--domino-chunks auto`` does (:meth:`~megatron_domino.training.megatron_lm.DominoModelHook.switch`):
Domino computes what stock computes, so every step of the comparison is an ordinary training
step and the run's losses are those of a run without it.

Each step gives two numbers, the slowest rank's step time and the most-blocked rank's time in
tensor-parallel waits (:class:`~.tp_wait.TPWaitClock`, the same clock for both arms). From the
per-arm medians: the ratio of Domino's to stock's step time (below 1: Domino is faster), the
exposed TP wait of each, and Domino's *chunking cost*, the rest of the difference:
``(domino - domino_wait) - (stock - stock_wait)``, i.e. what the smaller GEMMs, the extra
kernel launches and per-chunk Python cost beyond the waits Domino removed.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

__all__ = ["DOMINO", "STOCK", "DominoAB"]

STOCK, DOMINO = "stock", "domino"


@dataclass
class _Arm:
    seconds: list[float] = field(default_factory=list)
    wait_s: list[float] = field(default_factory=list)

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def median_wait_s(self) -> float:
        return statistics.median(self.wait_s)


class DominoAB:
    """The comparison's schedule and its result.

    Args:
        setting: the Domino setting's short name (``p2``, ``s2``, ``p2-k2``).
        iterations: measured steps per arm (``--domino-ab``, >= 1).
    """

    def __init__(self, setting: str, iterations: int) -> None:
        if iterations < 1:
            raise ValueError(f"--domino-ab needs at least 1 iteration per arm, got {iterations}.")
        self.setting = setting
        self._iterations = iterations
        self._steps = 0
        self._arms = {STOCK: _Arm(), DOMINO: _Arm()}

    @staticmethod
    def steps_needed(iterations: int) -> int:
        """Steps a comparison of ``iterations`` per arm takes: two warm-ups, then both arms."""
        return 2 * iterations + 2

    @property
    def steps_needed_total(self) -> int:
        """This comparison's :meth:`steps_needed`."""
        return self.steps_needed(self._iterations)

    @property
    def steps_left(self) -> int:
        """Steps still to run (warm-ups included)."""
        return max(self.steps_needed_total - self._steps, 0)

    @property
    def done(self) -> bool:
        return self._steps >= self.steps_needed_total

    def _arm(self, index: int) -> str:
        if index >= self.steps_needed(self._iterations):
            return DOMINO
        return DOMINO if index % 2 == 0 else STOCK

    @property
    def current(self) -> str:
        """The arm (:data:`STOCK` or :data:`DOMINO`) the next step runs."""
        return self._arm(self._steps)

    def record(self, seconds: float, wait_s: float) -> str | None:
        """Account one step of :attr:`current`; the next step's arm if it differs, else ``None``.

        The first two steps (one per arm) are warm-up and not counted.
        """
        if self.done:
            return None
        arm = self.current
        if self._steps >= 2:
            self._arms[arm].seconds.append(seconds)
            self._arms[arm].wait_s.append(wait_s)
        self._steps += 1
        return None if self.current == arm else self.current

    def _result(self) -> dict:
        if not self.done:
            raise RuntimeError("The A/B comparison has not run every step yet.")
        stock, domino = self._arms[STOCK], self._arms[DOMINO]
        chunking = (domino.median_s - domino.median_wait_s) - (stock.median_s - stock.median_wait_s)
        return {
            "setting": self.setting,
            "iterations": self._iterations,
            "stock_s": stock.median_s,
            "domino_s": domino.median_s,
            "ratio": domino.median_s / stock.median_s,
            "stock_tp_wait_s": stock.median_wait_s,
            "domino_tp_wait_s": domino.median_wait_s,
            "chunking_cost_s": chunking,
            "stock_seconds": stock.seconds,
            "domino_seconds": domino.seconds,
        }

    def record_dict(self) -> dict:
        """The result for ``--log-json`` (``{"kind": "domino_ab", ...}`` without the kind)."""
        return self._result()

    def line(self) -> str:
        """The answer in one line, e.g. ``Domino p2: 1.17x stock's iteration time on this run
        (slower; median of 5 each: 0.482 s vs 0.412 s; exposed TP wait 38.0 ms -> 9.0 ms,
        chunking cost +82.0 ms)``."""
        r = self._result()
        verdict = "faster" if r["ratio"] < 1 else "slower" if r["ratio"] > 1 else "the same"
        return (
            f"Domino {r['setting']}: {r['ratio']:.2f}x stock's iteration time on this run "
            f"({verdict}; median of {r['iterations']} each: {r['domino_s']:.4f} s vs "
            f"{r['stock_s']:.4f} s; exposed TP wait {1e3 * r['stock_tp_wait_s']:.1f} ms -> "
            f"{1e3 * r['domino_tp_wait_s']:.1f} ms, chunking cost "
            f"{1e3 * r['chunking_cost_s']:+.1f} ms)"
        )
