"""Domino on Transformer Engine layers, checked on the CPU with TE's contract (``te_stand_in``).

Each rank builds a TP = 2 model from Megatron's TE layer spec shape (norms fused into the
column-parallel linears, the layers' own norms ``IdentityOp``) with the stand-ins of
:mod:`te_stand_in` in place of TE's linears, runs a forward and backward with the stock block,
then with Domino, and compares the per-token loss and every gradient.

Under sequence parallelism the fused norms' weight gradients are compared after summing them
over the TP ranks (what ``finalize_model_grads`` does for parameters marked
``sequence_parallel``): stock TE computes complete sums over each rank's shard, Domino partial
sums over the full sequence (see :mod:`megatron_domino.te_linears`); only the totals agree.

Tolerances: :data:`megatron_domino.analysis.equivalence.TOLERANCES` (fp32 ``atol = 1e-6, rtol = 1e-5``).
What this does not show: that real TE keeps the contract (see
``tests/gpu/test_transformer_engine_gpu.py``, which needs TE and two GPUs), or anything about FP8
numerics.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from multiproc import run_on_ranks
from te_stand_in import (
    FP8_CONTEXT_DEPTH,
    stand_in_linears,
    stand_in_te_layer_spec,
    stand_in_te_norms_apart_layer_spec,
    take_calls,
)
from tiny_models import LLAMA_STYLE

import megatron_domino.block
from megatron_domino.analysis.criteria import count_mismatches, overlap_violations
from megatron_domino.analysis.equivalence import compare_with_stock, token_batch, tolerance_for
from megatron_domino.apply import apply_domino
from megatron_domino.config import DominoConfig, DominoUnsupportedError
from megatron_domino.harness.gpt_model import GPTOptions, build_gpt_model
from megatron_domino.harness.settings import setting as named_setting

LAYERS = 2
MODEL = dict(num_layers=LAYERS, **LLAMA_STYLE)
#: The settings (names: megatron_domino.harness.settings). Without SP, TE keeps its backward
#: all-reduce, so backward overlap must be off (see refusals.te_problems).
SETTINGS = [
    named_setting(name)
    for name in (
        "sp-p2",
        "sp-p4",
        "sp-p2-intra-layer",
        "p2-no-backward-overlap",
        "p4-no-backward-overlap",
    )
]


def _options(sequence_parallel: bool, **changes) -> GPTOptions:
    return GPTOptions(**{**MODEL, "sequence_parallel": sequence_parallel, **changes})


def _build(options: GPTOptions) -> torch.nn.Module:
    """The TE layer Domino runs: under SP with its norms apart (fused, it is refused)."""
    if options.sequence_parallel:
        return build_gpt_model(options, spec=stand_in_te_norms_apart_layer_spec())
    return build_gpt_model(options, spec=stand_in_te_layer_spec())


def _compare(sequence_parallel: bool) -> dict:
    """On every rank: each setting against the stock block; spans and TE calls per setting."""
    options = _options(sequence_parallel)
    model = _build(options)
    linears = stand_in_linears(model)
    settings = {n.name: n.config for n in SETTINGS if n.sequence_parallel == sequence_parallel}
    comparison = compare_with_stock(
        model, token_batch(options, 4), settings, tolerance_for(options), record=True,
        observe=functools.partial(take_calls, linears),
    )  # fmt: skip
    assert comparison.revert_error == 0, "revert changed the model"
    found = {}
    for name, compared in comparison.settings.items():
        assert compared.passed, (name, compared.mismatches[:3], compared.left_pending)
        found[name] = dict(
            spans=compared.spans, calls=sum(compared.observed, []), max_error=compared.max_error
        )
    return found


@pytest.fixture(scope="module", params=[True, False], ids=["sequence-parallel", "no-sp"])
def compared(request):
    return request.param, run_on_ranks(_compare, 2, args=(request.param,))[0]


def test_matches_stock_and_runs_te_without_its_collectives(compared):
    """Loss and gradients match stock; every TE call made by Domino ran without TE's own
    collectives, except the column linears without sequence parallelism, which keep TE's
    backward all-reduce."""
    sequence_parallel, results = compared
    for setting, found in results.items():
        assert found["max_error"] < 1e-6, setting
        modes = {(call.parallel_mode, call.sequence_parallel) for call in found["calls"]}
        expected = {(None, False)} if sequence_parallel else {(None, False), ("column", False)}
        assert modes == expected, (setting, modes)


def test_collectives_match_the_schedule_and_overlap(compared):
    """Counts as for Megatron's linears (SP: gathers and scatters in both directions; no SP:
    forward all-reduces only); with inter-layer overlap (intra-layer mode drains each layer),
    every collective but the schedule's first and last overlapped other work."""
    sequence_parallel, results = compared
    for named in SETTINGS:
        if named.sequence_parallel != sequence_parallel:
            continue
        setting, config = named.name, named.config
        spans = results[setting]["spans"]
        wrong = count_mismatches(
            spans,
            config,
            num_layers=LAYERS,
            sequence_parallel=sequence_parallel,
            embedding=not sequence_parallel,
            output_layer=not sequence_parallel,
        )
        assert not wrong, (setting, wrong)
        if not config.inter_layer:
            continue
        violations = overlap_violations(spans, config, sequence_parallel=sequence_parallel)
        assert not violations, (setting, violations[:3])


def _first_microbatch_flags(fuse_wgrad_accumulation: bool, sequence_parallel: bool) -> list:
    """``is_first_microbatch`` as TE would see it, per call, for one Domino forward."""
    options = _options(sequence_parallel)
    model = _build(options)
    linears = stand_in_linears(model)
    for linear in linears:
        linear.fuse_wgrad_accumulation = fuse_wgrad_accumulation
    config = DominoConfig(chunks=2, backward_overlap=sequence_parallel)
    with apply_domino(model, config):
        model(**token_batch(options, 4))
    return [[call.is_first_microbatch for call in linear.calls] for linear in linears]


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sequence-parallel", "no-sp"])
def test_first_microbatch_flag_keeps_weight_gradients_accumulating(sequence_parallel):
    """TE would overwrite main_grad in the backward of a call flagged first (with fused
    weight-gradient accumulation), and the first chunk's backward runs last: Domino never
    passes True. It passes False to every chunk, with or without fusion, after dropping TE's
    cached FP8 weight, so the first chunk's call casts it afresh and the others reuse it
    (``tests/ranks/test_te_contract.py`` counts the casts)."""
    for fused in (True, False):
        flags = run_on_ranks(_first_microbatch_flags, 2, args=(fused, sequence_parallel))[0]
        assert all(linear_flags == [False, False] for linear_flags in flags), (fused, flags)


def _fp8_context_use() -> tuple[int, set]:
    """FP8 (delayed): how often the block entered an FP8 context, and whether each call was in."""
    options = _options(True)
    model = _build(options)
    model.config.fp8, model.config.fp8_recipe = "hybrid", "delayed"
    entered = []

    @contextlib.contextmanager
    def fp8_autocast_stand_in(config):
        entered.append(config.fp8_recipe)
        FP8_CONTEXT_DEPTH[0] += 1
        try:
            yield
        finally:
            FP8_CONTEXT_DEPTH[0] -= 1

    megatron_domino.block.get_fp8_context = fp8_autocast_stand_in
    with apply_domino(model, DominoConfig(chunks=4)):
        model(**token_batch(options, 4))
    calls = [call for linear in stand_in_linears(model) for call in linear.calls]
    return len(entered), {call.in_fp8_context for call in calls}


def test_fp8_context_wraps_all_chunks_once():
    """One fp8_autocast per block forward around every chunk's TE calls, so TE reduces amaxes
    and updates scales once per micro-batch, as the stock block does."""
    entered, in_context = run_on_ranks(_fp8_context_use, 2)[0]
    assert entered == 1
    assert in_context == {True}


def _fused_norm_refusal() -> str:
    model = build_gpt_model(_options(True), spec=stand_in_te_layer_spec())
    with pytest.raises(DominoUnsupportedError) as error:
        apply_domino(model, DominoConfig(chunks=2))
    return str(error.value)


def test_fused_norms_are_refused_under_sequence_parallelism():
    """TE's fused norm + column linear under SP would make Domino gather the pre-norm residual
    (the norm run tp times, the whole chunk kept for backward): refused, naming the spec that
    builds the norms apart."""
    message = run_on_ranks(_fused_norm_refusal, 2)[0]
    assert "--spec megatron_domino.te_spec te_norms_apart_block_spec" in message, message


def _refusal(sequence_parallel: bool, settings: dict, model_changes: dict) -> str:
    model = _build(_options(sequence_parallel))
    for name, value in model_changes.items():
        setattr(model.config, name, value)
    with pytest.raises(DominoUnsupportedError) as error:
        apply_domino(model, DominoConfig(**settings))
    return str(error.value)


@pytest.mark.parametrize(
    "sequence_parallel, settings, model_changes, expected",
    [
        (True, dict(chunks=2, column_chunks=2), {}, "--domino-column-chunks > 1 needs"),
        (False, dict(chunks=2), {}, "add --no-domino-backward-overlap"),
        (
            True,
            dict(chunks=2),
            dict(fp8="hybrid", fp8_recipe="tensorwise"),
            "--fp8-recipe tensorwise computes scales",
        ),
        (True, dict(chunks=2), dict(symmetric_ar_type="two_shot"), "symmetric all-reduce"),
        (True, dict(chunks=2), dict(tp_comm_overlap=True), "TE userbuffer overlap"),
    ],
    ids=["column-chunks", "no-sp-backward-overlap", "fp8-tensorwise", "symmetric-ar", "ub"],
)
def test_refusals_name_the_problem_and_the_fix(
    sequence_parallel, settings, model_changes, expected
):
    message = run_on_ranks(_refusal, 2, args=(sequence_parallel, settings, model_changes))[0]
    assert expected in message, message
