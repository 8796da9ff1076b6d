"""Thin hooks around Megatron-LM's training loop for what it does not record itself.

Megatron-LM logs every ``--log-interval`` iterations, averaging over the interval (and its
second logged iteration shows the mean of the first two), so a comparison of two runs step
by step needs a per-iteration source. The hooks wrap two functions the loop looks up in
``megatron.training.training`` at call time, and change nothing they compute:

* ``train_step``: with ``--log-json PATH``, one JSON line per optimizer step
  (``{"kind": "train", "iteration", "loss", "grad_norm", "learning_rate", "skipped",
  "seconds"}``); with ``--domino-report``, the steps of the reported iterations run with an
  :class:`~megatron_domino.base.recorder.EventRecorder` in every model chunk's Domino runtime, and
  the overlap report is printed after them (:mod:`.domino_report`);
  with ``--domino-chunks auto``, each step's time (the slowest rank's) goes to the tuner,
  which switches the setting between steps (:meth:`.DominoModelHook.tune`); the report
  records only once the tuner is done, and the choice is printed and written as
  ``{"kind": "domino_auto", "iteration", "choice", "medians_s", "rounds"}``;
* ``evaluate`` (inside ``evaluate_and_print_results``, which names the set): with
  ``--log-json``, ``{"kind": "validation", "iteration", "loss", "final"}`` (``"test"`` for the
  test set); ``final`` is true for the evaluations Megatron runs after the last iteration,
  which repeat the last in-training one when ``--eval-interval`` divides ``--train-iters``.

With ``--domino-ab N`` (:mod:`.domino_ab`) the first steps alternate stock and Domino and
each step's time and TP waits (:mod:`.tp_wait`) go to the comparison, which prints one line
and writes ``{"kind": "domino_ab", "iteration", "ratio", ...}``; the report then records
after it and carries its "against stock" numbers.

The loss is the one ``train_step`` returns: Megatron's token-weighted mean over the global
batch, known on the last pipeline stage, so the last rank writes the file (it is on the last
stage in Megatron's rank order). Seconds are measured around ``train_step``, between device
synchronisations only when an output reads them (``--log-json``, ``--domino-chunks auto``,
``--domino-ab``); otherwise the step runs unsynchronised and ``seconds`` is not recorded
(no ``--log-json``, nothing to record it in).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

import torch
from megatron.training import training as megatron_training

from megatron_domino.base.config import AUTO
from megatron_domino.runtime.patch import Patch
from megatron_domino.training.domino_ab import STOCK, DominoAB
from megatron_domino.training.domino_report import (
    DominoOverlapReport,
    add_domino_report_args,
    domino_report_problems,
    steps_after_comparison,
)
from megatron_domino.training.runs import append_record
from megatron_domino.training.tp_wait import TPWaitClock

__all__ = ["LoopHooks", "add_loop_hook_args", "loop_hook_problems"]


def add_loop_hook_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--log-json``, ``--domino-report`` (:mod:`.domino_report`'s) and ``--domino-ab``
    (flags of this project's entry points, not Megatron-LM's)."""
    group = parser.add_argument_group("megatron-domino logging")
    group.add_argument(
        "--log-json",
        default=None,
        metavar="PATH",
        help="Append one JSON line per training iteration (loss, grad norm, learning rate, "
        "seconds) and per evaluation to PATH, unaveraged, for step-by-step comparisons.",
    )
    add_domino_report_args(group)
    group.add_argument(
        "--domino-ab",
        type=int,
        default=0,
        metavar="N",
        help="With --domino: after a warm-up step of each, run N stock and N Domino "
        "optimizer steps alternately in this run (ordinary training steps; Domino is "
        "reverted and re-applied between them), then print each arm's median step time, "
        "the ratio, and the exposed TP wait of each; also to --log-json. Needs "
        "--train-iters >= 2N+2. Default: 0 (off).",
    )
    return parser


def loop_hook_problems(args: argparse.Namespace) -> list[str]:
    """What is wrong with the flags of :func:`add_loop_hook_args` (empty when nothing).

    Checked at argument time by both entry points, before anything is written."""
    problems = domino_report_problems(args)
    if args.domino_ab < 0:
        problems.append(f"--domino-ab must be >= 0 (0: off), got {args.domino_ab}.")
    if args.domino_ab <= 0:
        return problems
    if not args.domino:
        problems.append("--domino-ab compares stock with Domino's setting; add --domino.")
    elif args.domino_chunks == AUTO:
        problems.append(
            "--domino-ab times one Domino setting against stock and --domino-chunks auto "
            "switches settings on the same first steps: give --domino-chunks a number, or "
            "drop --domino-ab (auto prints every candidate's time)."
        )
    after = steps_after_comparison(args)
    needed = DominoAB.steps_needed(args.domino_ab) + after
    if args.train_iters is not None and args.train_iters < needed:
        also = f" and {after} for --domino-report" if after else ""
        problems.append(
            f"--domino-ab {args.domino_ab} needs {DominoAB.steps_needed(args.domino_ab)} "
            f"training iterations (a warm-up step of each arm, then {args.domino_ab} each)"
            f"{also}, but --train-iters is {args.train_iters}: train longer or lower "
            "--domino-ab."
        )
    if args.train_iters is None:
        problems.append("--domino-ab counts iterations: give --train-iters, not --train-samples.")
    return problems


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _is_last_rank() -> bool:
    return torch.distributed.get_rank() == torch.distributed.get_world_size() - 1


def _slowest(*values: float) -> list[float]:
    """Each value's maximum over the ranks (every rank must feed the same times)."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return tensor.tolist()


class LoopHooks:
    """The wrappers of ``train_step`` and ``evaluate`` for one run.

    Args:
        log_json: path of the JSON-lines file (``--log-json``), or ``None``.
        train_iters: the run's last iteration (``--train-iters``; ``None`` for
            ``--train-samples``, which ``--domino-ab`` refuses).
        domino_report: the overlap report (``--domino-report``), or ``None``.
        domino_hook: Domino's model hook, whose tuner (``--domino-chunks auto``) gets the
            step times and which switches between stock and Domino for ``domino_ab``;
            ``None`` without ``--domino``.
        domino_ab: the stock-vs-Domino comparison (``--domino-ab``), or ``None``.
    """

    def __init__(
        self,
        log_json: str | None,
        train_iters: int | None = None,
        domino_report: DominoOverlapReport | None = None,
        domino_hook=None,
        domino_ab: DominoAB | None = None,
    ) -> None:
        self._log_json = Path(log_json) if log_json else None
        self._train_iters = train_iters
        self._domino_report = domino_report
        self._domino_hook = domino_hook
        self._domino_ab = domino_ab
        self._tp_wait = TPWaitClock() if domino_ab else None
        self._train_step = megatron_training.train_step
        self._evaluate = megatron_training.evaluate
        self._evaluate_and_print_results = megatron_training.evaluate_and_print_results
        self._evaluating: tuple[str, int, bool] | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace, domino_hook=None) -> LoopHooks:
        """The hooks ``args`` ask for (flags checked by :func:`loop_hook_problems`), around
        ``domino_hook`` (:func:`~megatron_domino.training.megatron_lm.add_hook`'s, or ``None``)."""
        domino_ab = None
        if domino_hook is not None and args.domino_ab > 0:
            from megatron_domino.base.settings import setting_name

            domino_ab = DominoAB(setting_name(domino_hook.config), args.domino_ab)
        report = DominoOverlapReport.from_args(args, domino_hook, domino_ab)
        return cls(args.log_json, args.train_iters, report, domino_hook, domino_ab)

    def patches(self) -> tuple[Patch, ...]:
        return (
            Patch(megatron_training, "train_step", self.train_step, "per-iteration records"),
            Patch(megatron_training, "evaluate", self.evaluate, "validation records"),
            Patch(
                megatron_training,
                "evaluate_and_print_results",
                self.evaluate_and_print_results,
                "names the evaluated set and iteration",
            ),
        )

    def write(self, record: dict) -> None:
        """Append ``record`` to ``--log-json`` (on the last rank only)."""
        if self._log_json is not None and _is_last_rank():
            append_record(self._log_json, record)

    def train_step(self, *args, iteration: int | None = None, **kwargs):
        """Megatron's ``train_step`` (``iteration`` steps done before it), recorded."""
        step = iteration + 1
        optimizer = args[3] if len(args) > 3 else kwargs["optimizer"]
        learning_rate = optimizer.param_groups[0]["lr"]  # the one this step applies
        tuning = self._domino_hook is not None and self._domino_hook.tuning
        comparing = self._domino_ab is not None and not self._domino_ab.done
        if comparing and self._domino_ab.steps_left == self._domino_ab.steps_needed_total:
            comparing = self._comparison_fits(iteration)
        report = self._domino_report if not (tuning or comparing) else None
        timed = self._log_json is not None or tuning or comparing
        with contextlib.ExitStack() as around:
            if report is not None:
                around.enter_context(report.reporting(step, self.write))
            if comparing:
                around.enter_context(self._tp_wait.measuring())
            if timed:
                _synchronize()
            start = time.perf_counter()
            result = self._train_step(*args, iteration=iteration, **kwargs)
            if timed:
                _synchronize()
            seconds = time.perf_counter() - start
            self._write_train(step, result, learning_rate, seconds)  # before the step's report
        if tuning:
            self._tune(step, seconds)
        elif comparing:
            self._compare(step, seconds)
        return result

    def _write_train(self, step: int, result, learning_rate: float, seconds: float) -> None:
        """The step's ``train`` record from ``train_step``'s result (where it has the loss)."""
        loss_dict, skipped, grad_norm = result[0], result[1], result[5]
        if "lm loss" in loss_dict:
            self.write(
                {
                    "kind": "train",
                    "iteration": step,
                    "loss": float(loss_dict["lm loss"]),
                    "grad_norm": None if grad_norm is None else float(grad_norm),
                    "learning_rate": learning_rate,
                    "skipped": bool(skipped),
                    "seconds": seconds,
                }
            )

    def _tune(self, step: int, seconds: float) -> None:
        """Feed the slowest rank's step time to the tuner; say what it chose when done."""
        hook = self._domino_hook
        hook.tune(_slowest(seconds)[0])
        if not hook.tuning:
            if torch.distributed.get_rank() == 0:
                print(hook.tuner.summary(), flush=True)
            self.write({"kind": "domino_auto", "iteration": step, **hook.tuner.record_dict()})

    def _comparison_fits(self, iteration: int) -> bool:
        """At the first step: whether the run has the steps ``--domino-ab`` needs left (a
        resumed run may not; argument time checked ``--train-iters`` from iteration 0).
        If not, say so on rank 0 and drop the comparison; the run trains on with Domino."""
        left = self._train_iters - iteration
        if left >= self._domino_ab.steps_left:
            return True
        if torch.distributed.get_rank() == 0:
            print(
                f"Domino A/B not run: --domino-ab needs {self._domino_ab.steps_left} "
                f"iterations and this run (resumed at iteration {iteration}) has {left} left; "
                "raise --train-iters to compare.",
                flush=True,
            )
        self._domino_ab = None
        return False

    def _compare(self, step: int, seconds: float) -> None:
        """Feed the step (slowest rank's time, most-blocked rank's TP wait) to the A/B;
        switch the model between stock and Domino; say the answer when done."""
        ab, hook = self._domino_ab, self._domino_hook
        next_arm = ab.record(*_slowest(seconds, self._tp_wait.take()))
        if next_arm is not None:
            hook.switch(None if next_arm == STOCK else hook.config)
        if ab.done:
            if torch.distributed.get_rank() == 0:
                print(ab.line(), flush=True)
            self.write({"kind": "domino_ab", "iteration": step, **ab.record_dict()})

    def evaluate_and_print_results(self, prefix, *args, **kwargs):
        """Megatron's evaluation of one set; names the set and iteration for :meth:`evaluate`.

        Megatron's prefix is ``iteration N`` during training, then ``... on validation set``
        and ``... on test set`` after it; ``iteration`` is the fifth positional argument.
        """
        iteration = args[3] if len(args) > 3 else kwargs["iteration"]
        kind = "test" if "test set" in prefix else "validation"
        self._evaluating = (kind, iteration, prefix.endswith(" set"))
        try:
            return self._evaluate_and_print_results(prefix, *args, **kwargs)
        finally:
            self._evaluating = None

    def evaluate(self, *args, **kwargs):
        """Megatron's ``evaluate``; its mean loss recorded with the set and iteration."""
        result = self._evaluate(*args, **kwargs)
        if self._evaluating is not None and "lm loss" in result[0]:
            kind, iteration, final = self._evaluating
            loss = float(result[0]["lm loss"])
            self.write({"kind": kind, "iteration": iteration, "loss": loss, "final": final})
        return result
