"""``--domino-chunks auto``'s pieces without a process group: the tuner's rounds and choice,
the candidates a model allows, and the flag's parsing.

That a run switching settings between steps still trains exactly like stock Megatron-Core is
``tests/runs/test_domino_training.py``'s ``tp2-auto`` case; that the choice is the fastest of the
measured settings is a benchmark question (``make bench``, the ``auto`` columns).
"""

from __future__ import annotations

import argparse

import pytest

from megatron_domino.autotune import (
    AutoTuner,
    NoCandidateError,
    add_auto_tune_args,
    candidate_configs,
)
from megatron_domino.base.config import DominoConfig, DominoConfigError, add_domino_args
from megatron_domino.base.settings import setting_name

P2, P4, P1K2 = (
    DominoConfig(chunks=2),
    DominoConfig(chunks=4),
    DominoConfig(chunks=1, column_chunks=2),
)


def test_tuner_runs_rounds_skips_warmup_and_picks_the_fastest_median():
    tuner = AutoTuner([P2, P4, P1K2], rounds=2, warmup_rounds=1)
    assert tuner.iterations == 9
    # Warm-up round: P4 is slowest there (first calls), which must not count against it.
    times = {P2: [9.0, 1.0, 1.2], P4: [50.0, 0.9, 0.95], P1K2: [9.0, 2.0, 2.0]}
    ran, switches = [], []
    for round_index in range(3):
        for _ in range(3):
            config = tuner.current
            ran.append(config)
            switches.append(tuner.record(times[config][round_index]))
    assert ran == [P2, P4, P1K2] * 3
    # The setting changes after every iteration but the last, which moves to the choice.
    assert switches == [P4, P1K2, P2, P4, P1K2, P2, P4, P1K2, P4]
    assert tuner.done and tuner.current == P4 and tuner.record(5.0) is None
    assert tuner.choice.config == P4 and tuner.choice.median == pytest.approx(0.925)
    assert tuner.record_dict() == {
        "choice": "p4",
        "medians_s": {"p2": 1.1, "p4": pytest.approx(0.925), "p1-k2": 2.0},
        "rounds": 2,
    }
    summary = tuner.summary()
    assert summary.startswith("Domino auto: chose p4 (--domino-chunks 4 --domino-column-chunks 1")
    assert "p1-k2  2.0000 s  (+116.2%)" in summary


def test_no_choice_before_every_candidate_ran():
    tuner = AutoTuner([P2, P4])
    tuner.record(1.0)
    with pytest.raises(RuntimeError, match="not measured every candidate"):
        tuner.choice  # noqa: B018


def test_candidates_are_the_settings_the_shapes_allow():
    def problems(config):
        return config.shape_problems(micro_batch_size=2, hidden_size=64, seq_length=32)

    chosen, refused = candidate_configs(problems, inter_layer=False)
    assert [setting_name(c) for c in chosen] == ["p2", "p2-k2", "p1-k2", "s2", "s4"]
    assert set(refused) == {"p4", "p4-k2"}
    assert "--micro-batch-size 2 is not divisible by --domino-chunks 4" in refused["p4"][0]
    assert all(not c.inter_layer for c in chosen)


def test_no_candidate_names_each_reason_once_with_its_settings():
    def problems(config):
        reasons = ["TP = 1 leaves nothing to overlap."]
        if config.split_along == "sequence":
            reasons.append("the sequence split needs causal attention.")
        return reasons

    with pytest.raises(NoCandidateError) as error:
        candidate_configs(problems)
    message = str(error.value)
    assert message.count("TP = 1 leaves nothing to overlap.") == 1
    assert "- s2, s4: the sequence split needs causal attention." in message


def _parse(*flags: str) -> argparse.Namespace:
    return add_auto_tune_args(add_domino_args(argparse.ArgumentParser())).parse_args(list(flags))


def test_the_flag_takes_a_number_or_auto():
    assert _parse("--domino-chunks", "auto").domino_chunks == "auto"
    assert _parse("--domino-chunks", "4").domino_chunks == 4
    with pytest.raises(SystemExit):
        _parse("--domino-chunks", "many")


def test_auto_is_not_one_config_and_owns_the_split_and_the_column_chunks():
    args = _parse(
        "--domino", "--domino-chunks", "auto", "--no-domino-inter-layer",
        "--domino-backward-order", "autograd",
    )  # fmt: skip
    with pytest.raises(DominoConfigError, match="describes candidates"):
        DominoConfig.from_args(args)
    assert DominoConfig.auto_fields(args) == {
        "inter_layer": False,
        "backward_overlap": True,
        "backward_order": "autograd",
    }
    for flag, value in (("--domino-split", "sequence"), ("--domino-column-chunks", "2")):
        args = _parse("--domino", "--domino-chunks", "auto", flag, value)
        with pytest.raises(DominoConfigError, match=f"chooses {flag} too; drop {flag} {value}"):
            DominoConfig.auto_fields(args)


# The patch's refusal of auto: tests/runs/test_patch_api.py (through the functions it calls).


def test_the_rounds_come_from_their_flag_and_a_count_below_one_is_refused():
    candidates = [DominoConfig(chunks=2)]
    assert AutoTuner.from_args(_parse("--domino-auto-iters", "2"), candidates).iterations == 3
    with pytest.raises(DominoConfigError, match="--domino-auto-iters must be >= 1, got 0"):
        AutoTuner.from_args(_parse("--domino-auto-iters", "0"), candidates)
