"""DominoConfig and its flags: pure Python, no process group."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from megatron_domino.base.config import DominoConfig, DominoConfigError, add_domino_args


def _parse(*flags: str) -> argparse.Namespace:
    return add_domino_args(argparse.ArgumentParser()).parse_args(list(flags))


def test_flags_map_one_to_one_onto_fields():
    args = _parse(
        "--domino",
        "--domino-chunks",
        "4",
        "--domino-column-chunks",
        "2",
        "--domino-split",
        "sequence",
        "--no-domino-inter-layer",
        "--no-domino-backward-overlap",
    )
    assert DominoConfig.from_args(args) == DominoConfig(
        chunks=4,
        column_chunks=2,
        split_along="sequence",
        inter_layer=False,
        backward_overlap=False,
    )
    parser_dests = {a.dest for a in add_domino_args(argparse.ArgumentParser())._actions}
    # Stored as domino_<field>, so they never collide with Megatron-LM's own arguments.
    assert {f"domino_{f.name}" for f in dataclasses.fields(DominoConfig)} <= parser_dests


def test_defaults_and_off():
    assert DominoConfig.from_args(_parse()) is None
    assert DominoConfig.from_args(_parse("--domino")) == DominoConfig()
    assert DominoConfig() == DominoConfig(
        chunks=2, column_chunks=1, split_along="batch", inter_layer=True, backward_overlap=True
    )


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(chunks=0), "--domino-chunks must be an integer >= 1"),
        (dict(column_chunks=-1), "--domino-column-chunks must be an integer >= 1"),
        (dict(chunks=True), "--domino-chunks must be an integer"),
        (dict(chunks=1, column_chunks=1), "nothing to overlap"),
        (dict(split_along="heads"), "--domino-split must be one of batch, sequence"),
    ],
)
def test_invalid_values_are_rejected_when_built(kwargs, words):
    with pytest.raises(DominoConfigError, match=words):
        DominoConfig(**kwargs)


def test_invalid_flags_fail_at_parse_time():
    with pytest.raises(DominoConfigError, match="nothing to overlap"):
        DominoConfig.from_args(_parse("--domino", "--domino-chunks", "1"))


def test_shape_checks_name_the_numbers_and_the_fix():
    config = DominoConfig(chunks=4, column_chunks=3)
    with pytest.raises(
        DominoConfigError, match="--micro-batch-size 6 is not divisible by --domino-chunks 4"
    ):
        config.check_shapes(micro_batch_size=6, hidden_size=96)
    with pytest.raises(
        DominoConfigError, match="--hidden-size 128 is not divisible by --domino-column-chunks 3"
    ):
        config.check_shapes(micro_batch_size=8, hidden_size=128)
    config.check_shapes(micro_batch_size=8, hidden_size=96)


def test_sequence_split_checks_the_sequence_not_the_micro_batch():
    config = DominoConfig(chunks=4, split_along="sequence")
    config.check_shapes(micro_batch_size=1, hidden_size=64, seq_length=1024)
    with pytest.raises(
        DominoConfigError, match="--seq-length 1022 is not divisible by --domino-chunks 4"
    ):
        config.check_shapes(micro_batch_size=1, hidden_size=64, seq_length=1022)


def test_config_is_frozen_and_keyword_only():
    with pytest.raises(TypeError):
        DominoConfig(2)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        DominoConfig().chunks = 3  # type: ignore[misc]
