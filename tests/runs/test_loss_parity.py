"""``python -m lab.loss_parity``: its flags, and a real baseline-vs-Domino run.

Tolerance of the run: 1e-5 absolute on losses near 6, i.e. about 20 fp32 ulps. In fp32 with
dropout 0 the two arms differ only by the summation order of GEMMs on half-size batches;
measured worst over 30 iterations of the command's default model (both arms through
Megatron-LM's own loop): 9.5e-7 (two ulps), with 25 of 30 iterations bit-identical.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from megatron.training import arguments as megatron_arguments

from lab import loss_parity
from lab.loss_parity import LossParityError, arm_flags, compare, parse_args
from megatron_domino.training import pretrain as entry
from megatron_domino.training.runs import MODULE, cpu_flags, torchrun_command

TOLERANCE = 1e-5


def test_training_flags_pass_through_and_the_domino_arm_adds_its_own():
    args, training = parse_args(["--output-dir", "out", "--train-iters", "5",
                                 "--domino-flags", "--domino-chunks 4"])  # fmt: skip
    assert args.output_dir == Path("out") and training == ["--train-iters", "5"]
    flags = arm_flags(Path("out"), training, ["--domino-chunks", "4"])
    assert flags["baseline"][-4:] == ["--train-iters", "5", "--log-json", "out/baseline.jsonl"]
    assert flags["domino"][-4:] == ["out/domino.jsonl", "--domino", "--domino-chunks", "4"]
    assert "--mock-data" in flags["baseline"] and "--domino" not in flags["baseline"]


@pytest.mark.parametrize("arm", loss_parity.ARMS)
def test_each_arm_is_a_command_line_megatron_lm_accepts(arm, monkeypatch):
    """Megatron-LM's parser and validation, then the script's checks, as the script runs them
    before initialising anything (no launch)."""
    flags = arm_flags(Path("out"), ["--train-iters", "5"], ["--domino-chunks", "4"])[arm]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt_domino.py", *flags])
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.setattr(megatron_arguments, "get_device_arch_version", lambda: 9)
    args = megatron_arguments.parse_args(extra_args_provider=entry.add_flags)
    megatron_arguments.validate_args(args, dict(entry.ARGS_DEFAULTS))
    entry._script_checks(args)
    assert args.domino == (arm == "domino") and args.train_iters == 5
    assert args.transformer_impl == "local" and args.eval_iters == 0
    if not torch.cuda.is_available():
        assert " ".join(cpu_flags()) in " ".join(flags)
    command = torchrun_command(2, flags)
    assert command[command.index(flags[0]) - 2 :][:2] == ["-m", MODULE]


def test_a_data_path_replaces_the_default_mock_data():
    flags = arm_flags(Path("out"), ["--data-path", "d/text_document"], [])
    assert "--mock-data" not in flags["baseline"] and "NullTokenizer" not in flags["domino"]


@pytest.mark.parametrize("flag", ["--domino", "--domino-chunks", "--no-domino-inter-layer",
                                  "--log-json", "--save", "--load=ckpt"])  # fmt: skip
def test_flags_that_belong_to_the_command_or_one_arm_are_refused(flag):
    with pytest.raises(LossParityError, match=flag.split("=")[0]):
        parse_args([flag, "x"])


def test_runs_logging_different_iterations_are_not_compared():
    with pytest.raises(LossParityError, match="different iterations"):
        compare({1: 5.0, 2: 4.0}, {1: 5.0})
    result = compare({1: 5.0, 2: 4.0}, {1: 5.0, 2: 4.5})
    assert result["max_abs_diff"] == 0.5 and result["max_abs_diff_iteration"] == 2


@pytest.mark.slow
def test_baseline_and_domino_losses_match_in_fp32(tmp_path, capsys):
    out = tmp_path / "parity"
    status = loss_parity.main(["--output-dir", str(out), "--train-iters", "6",
                               "--tolerance", str(TOLERANCE)])  # fmt: skip
    printed = capsys.readouterr().out
    assert status == 0, printed[-4000:]
    result = json.loads((out / "loss_parity.json").read_text())
    curves = result["curves"]
    assert curves["iteration"] == [1, 2, 3, 4, 5, 6]
    assert len(curves["baseline"]) == len(curves["domino"]) == 6
    assert curves["baseline"][-1] < curves["baseline"][0]  # it trained
    assert result["max_abs_diff"] <= TOLERANCE and result["within_tolerance"] is True
    assert result["max_abs_diff"] == max(
        abs(b - d) for b, d in zip(curves["baseline"], curves["domino"], strict=True)
    )
    assert result["provenance"]["torch"] and result["domino_flags"] == ["--domino"]
    assert (out / "loss_parity.png").stat().st_size > 0
    assert "[loss-parity] 6 iterations: max |loss difference| " in printed


def test_dropout_seeds_mode_flags_seeds_and_refusals():
    args, training = parse_args(["--dropout-seeds", "3", "--train-iters", "5"])
    assert args.dropout_seeds == 3 and loss_parity.dropout_seeds(3) == [1234, 1235, 1236]
    flags = arm_flags(Path("out"), [*loss_parity.DROPOUT_ON, *training, "--seed", "1235"], [],
                      tag="-seed1235")  # fmt: skip
    words = " ".join(flags["domino"])
    # Dropout back on after the defaults' 0 (the last value counts), per-seed logs.
    assert words.index("--attention-dropout 0.1") > words.index("--attention-dropout 0 ")
    assert "--seed 1235 --log-json out/domino-seed1235.jsonl --domino" in words
    for argv, message in ((["--dropout-seeds", "1"], "at least 2 seeds"),
                          (["--dropout-seeds", "2", "--tolerance", "1e-5"], "drop --tolerance"),
                          (["--dropout-seeds", "2", "--seed", "7"], "seeds 1234, 1235")):  # fmt: skip
        with pytest.raises(LossParityError, match=message):
            parse_args(argv)


def test_the_seed_comparison_puts_dominos_mean_inside_or_outside_stocks_band():
    stock = [{1: 6.0, 2: 5.0, 3: 4.0}, {1: 6.2, 2: 5.2, 3: 4.2}]
    result = loss_parity.compare_seeds(stock, [{1: 6.05, 2: 5.1, 3: 4.1}, {1: 6.1, 2: 5.2, 3: 4.1}])
    assert result["domino_mean_inside_baseline_band"] == [True, True, True]
    assert result["inside_fraction"] == 1 and result["seeds"] == 2 and result["within_spread"]
    assert result["domino_band"]["mean"] == pytest.approx([6.075, 5.15, 4.1])
    assert result["first_iteration_paired_abs_diff"] == pytest.approx([0.05, 0.1])
    # A Domino that trains another model: its mean leaves the band as the curves fall.
    drifting = loss_parity.compare_seeds(stock, [{1: 6.1, 2: 5.3, 3: 4.5}] * 2)
    assert drifting["domino_mean_inside_baseline_band"] == [True, False, False]
    assert drifting["max_mean_gap"] == pytest.approx(0.4) and not drifting["within_spread"]
    with pytest.raises(LossParityError, match="different iterations"):
        loss_parity.compare_seeds(stock, [{1: 6.0, 2: 5.0}, {1: 6.0, 2: 5.0}])
