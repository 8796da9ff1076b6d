"""The ``train_step`` wrapper of :mod:`megatron_domino.training.loop_hooks` without processes:
device synchronisation only when a timing output reads it, and ``--domino-ab`` switching the
model between stock and Domino between steps."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from megatron_domino.base.config import DominoConfig
from megatron_domino.training import loop_hooks
from megatron_domino.training.domino_ab import DominoAB
from megatron_domino.training.domino_report import DominoOverlapReport
from megatron_domino.training.runs import read_records

OPTIMIZER = SimpleNamespace(param_groups=[{"lr": 1e-3}])


def _step_result(loss: float = 5.0):
    """What Megatron's ``train_step`` returns: (losses, skipped, ..., grad norm, ...)."""
    return ({"lm loss": torch.tensor(loss)}, False, False, 0, None, 1.0, None)


class _FakeHook:
    """A Domino model hook that records the switches asked of it."""

    def __init__(self) -> None:
        self.config = DominoConfig(chunks=2)
        self.tuning = False
        self.switches: list[DominoConfig | None] = []

    def switch(self, config):
        self.switches.append(config)


@pytest.fixture
def single_rank(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 1)
    monkeypatch.setattr(loop_hooks, "_slowest", lambda *values: list(values))
    syncs = []
    monkeypatch.setattr(loop_hooks, "_synchronize", lambda: syncs.append(1))
    return syncs


def _run(hooks: loop_hooks.LoopHooks, steps: int, first: int = 0) -> None:
    hooks._train_step = lambda *args, **kwargs: _step_result()
    for iteration in range(first, first + steps):
        hooks.train_step(None, None, None, OPTIMIZER, iteration=iteration)


def test_no_device_sync_without_a_timing_output(single_rank, tmp_path):
    _run(loop_hooks.LoopHooks(None), 3)
    assert single_rank == []  # issue 17: nothing reads the step time
    _run(loop_hooks.LoopHooks(str(tmp_path / "log.jsonl")), 3)
    assert len(single_rank) == 6  # --log-json's seconds: before and after each step
    assert [r["iteration"] for r in read_records(tmp_path / "log.jsonl", "train")] == [1, 2, 3]


def test_domino_ab_switches_between_steps_and_says_the_answer(single_rank, tmp_path, capsys):
    hook, log = _FakeHook(), tmp_path / "log.jsonl"
    hooks = loop_hooks.LoopHooks(str(log), 8, None, hook, DominoAB("p2", 2))
    hooks._tp_wait = SimpleNamespace(measuring=contextlib.nullcontext, take=lambda: 0.01)
    _run(hooks, 8)
    # Domino (warm-up), stock (warm-up), then Domino and stock twice, then Domino for good.
    assert hook.switches == [None, hook.config, None, hook.config, None, hook.config]
    (record,) = read_records(log, "domino_ab")
    assert record["iteration"] == 6 and record["stock_tp_wait_s"] == 0.01
    assert capsys.readouterr().out.count("Domino p2: ") == 1
    assert len(read_records(log, "train")) == 8


def test_a_resumed_run_too_short_for_the_ab_says_so_and_trains_on(single_rank, capsys):
    hook = _FakeHook()
    ab = DominoAB("p2", 2)
    report = DominoOverlapReport(lambda: [], 1, lambda: 8, against_stock=ab)
    hooks = loop_hooks.LoopHooks(None, 8, report, hook, ab)
    _run(hooks, 4, first=4)  # resumed at iteration 4 of 8: 4 left, 6 needed
    assert hook.switches == [] and hooks._domino_ab is None
    out = capsys.readouterr().out
    assert "Domino A/B not run: --domino-ab needs 6 iterations and this run (resumed at " in out
    # The report still runs, and says no stock reference was timed.
    assert "[domino-report] against stock: not timed in this run." in out
