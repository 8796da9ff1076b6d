"""``--domino-chunks auto``: choose the Domino setting by timing it on the run's own iterations.

Which setting is fastest depends on the shape, the link and the device: more chunks hide more
(each collective has another chunk's op to fly behind) but cost more per chunk (smaller GEMMs,
more kernel launches and autograd nodes, one weight-gradient accumulation per chunk). Both
sides can be measured per op, but their sum does not predict the iteration: overlapped
communication slows the compute it overlaps (on two CPU cores gloo's own work took 30 % off
the attention core's speed, docs/benchmarks.md), and that interference only shows when the
two run together. So the tuner measures the thing it optimises: each candidate runs whole
iterations of the real job, in rounds (every candidate once per round, so drift hits all
alike), and the one with the lowest median iteration time wins. The tuning iterations are
ordinary training iterations (Domino computes what stock Megatron-Core computes), so the
cost of tuning is only the time the slower candidates take.

The candidates (:func:`candidate_configs`) are the batch split with ``p`` in {2, 4} and ``k``
in {1, 2}, the column split alone (``p = 1, k = 2``), and the sequence split with ``p`` in
{2, 4}, minus those the shapes or the model refuse (each with its reason). The tuner
(:class:`AutoTuner`) is a small state machine fed one iteration time at a time; every rank
must feed the same times (the slowest rank's), so every rank switches to the same setting.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from megatron_domino.base.config import AUTO, DominoConfig, DominoConfigError
from megatron_domino.base.settings import setting_name

__all__ = [
    "AUTO",
    "AutoTuner",
    "NoCandidateError",
    "add_auto_tune_args",
    "candidate_configs",
]

#: (split, chunks, column chunks) tried, cheapest-looking first.
_CANDIDATES = (
    ("batch", 2, 1),
    ("batch", 2, 2),
    ("batch", 4, 1),
    ("batch", 4, 2),
    ("batch", 1, 2),
    ("sequence", 2, 1),
    ("sequence", 4, 1),
)


class NoCandidateError(DominoConfigError):
    """No Domino setting can run this model; the message gives each candidate's reason (a
    :class:`~megatron_domino.base.config.DominoConfigError`, so both entry points refuse it in one
    message like any other bad setting)."""


def candidate_configs(
    problems: Callable[[DominoConfig], list[str]], **fixed
) -> tuple[list[DominoConfig], dict[str, list[str]]]:
    """The settings the tuner tries, and the refused ones with their reasons.

    Args:
        problems: why a config cannot run this model (empty when it can): the shape rules
            and the refusals, e.g. ``config.shape_problems(...) + config_problems(...)``.
        fixed: the other :class:`DominoConfig` fields (``inter_layer``, ``backward_overlap``).
    Raises:
        NoCandidateError: every candidate is refused.
    """
    chosen, refused = [], {}
    for split, chunks, column_chunks in _CANDIDATES:
        config = DominoConfig(
            chunks=chunks, column_chunks=column_chunks, split_along=split, **fixed
        )
        reasons = problems(config)
        if reasons:
            refused[setting_name(config)] = reasons
        else:
            chosen.append(config)
    if not chosen:
        by_reason: dict[str, list[str]] = {}
        for name, reasons in refused.items():
            for reason in reasons:
                by_reason.setdefault(reason, []).append(name)
        listing = "\n".join(
            f"- {', '.join(names)}: {reason}" for reason, names in by_reason.items()
        )
        raise NoCandidateError(
            f"--domino-chunks auto found no Domino setting this model can run:\n{listing}"
        )
    return chosen, refused


@dataclass(frozen=True)
class Trial:
    """A candidate's measured iteration times (seconds)."""

    config: DominoConfig
    seconds: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def add_auto_tune_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--domino-auto-iters``: the tuner's measured rounds (:meth:`AutoTuner.from_args`)."""
    parser.add_argument_group("domino auto-tuning").add_argument(
        "--domino-auto-iters",
        type=int,
        default=3,
        metavar="N",
        help="With --domino-chunks auto: measured iterations per candidate setting (each "
        "after one unmeasured warm-up iteration); the candidates run in rounds. Default: 3.",
    )
    return parser


class AutoTuner:
    """Runs every candidate for ``warmup_rounds + rounds`` rounds, then the fastest.

    Feed it the time of each iteration with :meth:`record`; run the next iteration with
    :attr:`current`. Warm-up rounds (a candidate's first iterations: allocator growth, first
    calls) are not counted.

    Args:
        candidates: from :func:`candidate_configs` (at least one).
        rounds: measured iterations per candidate (``--domino-auto-iters``).
        warmup_rounds: unmeasured iterations per candidate before them.
    """

    def __init__(
        self, candidates: list[DominoConfig], rounds: int = 3, warmup_rounds: int = 1
    ) -> None:
        if not candidates:
            raise ValueError("AutoTuner needs at least one candidate.")
        if rounds < 1 or warmup_rounds < 0:
            raise ValueError(
                f"rounds must be >= 1 and warmup_rounds >= 0, got {rounds}, {warmup_rounds}."
            )
        self.candidates = list(candidates)
        self._trials = [Trial(config, []) for config in self.candidates]
        self._rounds = rounds
        self._warmup_rounds = warmup_rounds
        self._iteration = 0
        self._total = (rounds + warmup_rounds) * len(self.candidates)

    @classmethod
    def from_args(cls, args: argparse.Namespace, candidates: list[DominoConfig]) -> AutoTuner:
        """The tuner of ``--domino-chunks auto`` over ``candidates``, ``--domino-auto-iters``
        rounds each; a count below 1 is refused naming the flag."""
        if args.domino_auto_iters < 1:
            raise DominoConfigError(
                f"--domino-auto-iters must be >= 1, got {args.domino_auto_iters}."
            )
        return cls(candidates, rounds=args.domino_auto_iters)

    def __repr__(self) -> str:
        names = ", ".join(setting_name(config) for config in self.candidates)
        return (
            f"AutoTuner(candidates=[{names}], {self._warmup_rounds} warm-up + {self._rounds} "
            "measured iteration(s) each)"
        )

    @property
    def iterations(self) -> int:
        """Iterations the tuning takes (warm-up and measured, every candidate)."""
        return self._total

    @property
    def done(self) -> bool:
        return self._iteration >= self._total

    @property
    def current(self) -> DominoConfig:
        """The setting the next iteration runs with."""
        if self.done:
            return self.choice.config
        return self.candidates[self._iteration % len(self.candidates)]

    def record(self, seconds: float) -> DominoConfig | None:
        """Account one iteration run with :attr:`current`; return the next iteration's setting
        if it differs (the caller switches to it), else ``None``."""
        if self.done:
            return None
        before = self.current
        if self._iteration >= self._warmup_rounds * len(self.candidates):
            self._trials[self._iteration % len(self.candidates)].seconds.append(seconds)
        self._iteration += 1
        after = self.current
        return None if after == before else after

    @property
    def choice(self) -> Trial:
        """The fastest candidate by median iteration time (after all rounds)."""
        if not self.done:
            raise RuntimeError("The tuner has not measured every candidate yet.")
        return min(self._trials, key=lambda trial: trial.median)

    def summary(self) -> str:
        """The choice and why: every candidate's median, relative to the chosen one."""
        best = self.choice
        lines = [
            f"Domino auto: chose {setting_name(best.config)} (--domino-chunks "
            f"{best.config.chunks} --domino-column-chunks {best.config.column_chunks} "
            f"--domino-split {best.config.split_along}): median {best.median:.4f} s per "
            f"iteration over {self._rounds} iteration(s) each, the fastest of "
            f"{len(self._trials)} candidates:"
        ]
        for trial in sorted(self._trials, key=lambda t: t.median):
            lines.append(
                f"  {setting_name(trial.config):>6}  {trial.median:.4f} s  "
                f"({trial.median / best.median - 1:+.1%})"
            )
        return "\n".join(lines)

    def record_dict(self) -> dict:
        """The choice and the medians, for ``--log-json`` and the benchmark's JSON."""
        return {
            "choice": setting_name(self.choice.config),
            "medians_s": {setting_name(t.config): t.median for t in self._trials},
            "rounds": self._rounds,
        }
