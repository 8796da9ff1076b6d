"""``--domino-ab N``: the comparison's schedule and answer, its flag checks, and a real TP = 2
run of ``pretrain_gpt_domino.py`` whose A/B steps train exactly what a stock run trains."""

from __future__ import annotations

import re
import sys

import pytest
from launch import TINY_GPT, run_pretrain, train_records
from megatron.training import arguments as megatron_arguments

from megatron_domino.training import pretrain as entry
from megatron_domino.training.domino_ab import DOMINO, STOCK, DominoAB
from megatron_domino.training.domino_report import DominoOverlapReport
from megatron_domino.training.runs import read_records


def test_the_schedule_warms_up_each_arm_then_alternates_and_stays_on_domino():
    ab = DominoAB("p2", 2)
    arms, switches = [], []
    for step in range(8):
        arms.append(ab.current)
        switches.append(ab.record(seconds=1.0 + step, wait_s=0.1 * step))
    assert arms == [DOMINO, STOCK] + [DOMINO, STOCK] * 2 + [DOMINO, DOMINO]
    assert switches == [STOCK, DOMINO, STOCK, DOMINO, STOCK, DOMINO, None, None]
    assert ab.done and DominoAB.steps_needed(2) == 6
    result = ab.record_dict()
    # Steps 0 and 1 are warm-up; Domino ran steps 2 and 4, stock 3 and 5.
    assert result["domino_seconds"] == [3.0, 5.0] and result["stock_seconds"] == [4.0, 6.0]
    assert result["ratio"] == pytest.approx(4.0 / 5.0)
    assert result["domino_tp_wait_s"] == pytest.approx(0.3)
    assert result["stock_tp_wait_s"] == pytest.approx(0.4)
    # (4.0 - 0.3) - (5.0 - 0.4): Domino's step beyond its waits, against stock's.
    assert result["chunking_cost_s"] == pytest.approx(-0.9)


def test_the_line_says_ratio_verdict_medians_and_waits():
    ab = DominoAB("s2", 1)
    for seconds, wait_s in ((9.0, 9.0), (9.0, 9.0), (0.5, 0.009), (0.4, 0.038)):
        ab.record(seconds, wait_s)
    assert ab.line() == (
        "Domino s2: 1.25x stock's iteration time on this run (slower; median of 1 each: "
        "0.5000 s vs 0.4000 s; exposed TP wait 38.0 ms -> 9.0 ms, chunking cost +129.0 ms)"
    )
    with pytest.raises(RuntimeError, match="has not run every step"):
        DominoAB("p2", 1).line()


def test_the_report_ends_against_stock_or_says_it_was_not_timed():
    ab = DominoAB("p2", 1)
    for seconds in (1.0, 1.0, 0.5, 0.4):
        ab.record(seconds, 0.01)
    with_ab = DominoOverlapReport(lambda: [], 1, lambda: 4, against_stock=ab).against_stock_line()
    assert with_ab == f"[domino-report] against stock (--domino-ab, this run): {ab.line()}"
    without = DominoOverlapReport(lambda: [], 1, lambda: 4).against_stock_line()
    assert "not timed in this run" in without and "add --domino-ab N" in without


BASE = (
    f"{' '.join(TINY_GPT)} --tensor-model-parallel-size 2 --lr 1e-3 "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 100"
).split()


@pytest.mark.parametrize(("flags", "message"), [
    (["--domino-ab", "2"], "--domino-ab compares stock with Domino's setting; add --domino."),
    (["--domino", "--domino-ab", "-1"], "--domino-ab must be >= 0"),
    (["--domino", "--domino-ab", "3"], "--domino-ab 3 needs 8 training iterations"),
    (["--domino", "--domino-ab", "2", "--domino-report"], "and 4 for --domino-report"),
    (["--domino", "--domino-ab", "1", "--domino-chunks", "auto"], "give --domino-chunks a number"),
])  # fmt: skip
def test_flags_are_checked_before_anything_runs(flags, message, monkeypatch):
    argv = ["pretrain_gpt_domino.py", *BASE, "--train-iters", "7", *flags]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    args = megatron_arguments.parse_args(extra_args_provider=entry.add_flags)
    with pytest.raises(entry.StartupError, match=re.escape(message)):
        entry._script_checks(args)


@pytest.mark.slow
def test_tp2_run_prints_the_answer_and_trains_what_stock_trains(tmp_path):
    """Stock, and Domino with ``--domino-ab 2``: the same losses every iteration (the A/B
    steps are ordinary steps), one answer line, its record, and TP waits in both arms."""
    flags = [*BASE, "--train-iters", "6", "--data-cache-path", str(tmp_path / "cache")]
    flags += ["--attention-dropout", "0", "--hidden-dropout", "0"]  # chunks draw other masks
    stock_log, ab_log = tmp_path / "stock.jsonl", tmp_path / "ab.jsonl"
    run_pretrain([*flags, "--log-json", str(stock_log)], cwd=tmp_path)
    output = run_pretrain(
        [*flags, "--log-json", str(ab_log), "--domino", "--domino-ab", "2"], cwd=tmp_path
    )
    lines = re.findall(r"^Domino p2: .*$", output, flags=re.MULTILINE)
    assert len(lines) == 1, output[-3000:]
    assert re.fullmatch(
        r"Domino p2: \d+\.\d\dx stock's iteration time on this run \((faster|slower|the same); "
        r"median of 2 each: .* s vs .* s; exposed TP wait \d+\.\d ms -> \d+\.\d ms, chunking "
        r"cost [+-]\d+\.\d ms\)",
        lines[0],
    )
    (record,) = read_records(ab_log, "domino_ab")
    assert record["iteration"] == 6 and record["setting"] == "p2"
    assert len(record["stock_seconds"]) == len(record["domino_seconds"]) == 2
    assert record["ratio"] == pytest.approx(record["domino_s"] / record["stock_s"])
    # Stock's row-parallel all-reduces are synchronous and Domino waits on its own.
    assert record["stock_tp_wait_s"] > 0 and record["domino_tp_wait_s"] > 0
    stock, ab = train_records(stock_log), train_records(ab_log)
    assert sorted(stock) == sorted(ab) == list(range(1, 7))
    for iteration, step in stock.items():
        assert ab[iteration]["loss"] == pytest.approx(step["loss"], rel=1e-5), iteration
