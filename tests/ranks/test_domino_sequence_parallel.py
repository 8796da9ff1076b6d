"""Domino under sequence parallelism computes what Megatron-Core's sequence parallelism does.

Each rank builds one TP = 2 model with ``--sequence-parallel`` (residual stream ``[s/tp, b, h]``,
norms from :mod:`megatron_domino.specs.norms`), runs a forward and backward with the stock block,
then with Domino for each setting, and compares the per-token loss and every parameter's
gradient (:func:`~lab.analysis.equivalence.compare_with_stock`: the norms'
gradients summed over TP, as the optimizer sees them). The recorder must
show, per layer and chunk, an all-gather before each column-parallel linear and a
reduce-scatter after each row-parallel one (``k`` of them with column pieces), each matched in
backward, and nothing left in flight.

Tolerances: :data:`lab.analysis.equivalence.TOLERANCES` (fp32 ``atol = 1e-6, rtol = 1e-5``);
only the order of floating-point sums changes (measured differences are below 1e-7).
"""

from __future__ import annotations

import pytest
from multiproc import run_on_ranks
from tiny_models import LLAMA_STYLE, TINY

from lab.analysis.equivalence import compare_with_stock, token_batch, tolerance_for
from lab.models.gpt_model import GPTOptions, build_gpt_model
from megatron_domino.analysis.criteria import count_mismatches, overlap_violations
from megatron_domino.apply import apply_domino
from megatron_domino.base.config import DominoConfig, DominoUnsupportedError
from megatron_domino.base.settings import domino_configs

LAYERS = 2
MODELS = {
    "layernorm-gelu-learned": GPTOptions(
        num_layers=LAYERS, **TINY, num_attention_heads=4, sequence_parallel=True
    ),
    "rmsnorm-swiglu-rope-gqa": GPTOptions(
        num_layers=LAYERS, **LLAMA_STYLE, add_bias_linear=False, sequence_parallel=True
    ),
}
#: Domino settings on the sequence-parallel models (names: megatron_domino.base.settings).
SETTINGS = domino_configs("p2", "p4", "p2-k2", "p1-k2", "p2-intra-layer")


def _compare() -> dict:
    """On every rank: each setting against stock SP; the recorded spans per (model, setting)."""
    spans = {}
    for model_name, options in MODELS.items():
        model = build_gpt_model(options)
        batch = token_batch(options, 4)
        comparison = compare_with_stock(model, batch, SETTINGS, tolerance_for(options), record=True)
        for setting, compared in comparison.settings.items():
            assert compared.passed, (model_name, setting, compared.mismatches[:3])
            spans[(model_name, setting)] = compared.spans
        assert comparison.revert_error == 0, "revert changed it"
    return spans


@pytest.fixture(scope="module")
def spans():
    return run_on_ranks(_compare, 2)[0]


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_collectives_match_the_schedule(spans, setting):
    """Per layer and chunk: two gathers (QKV, fc1 inputs), two reduce-scatters of k pieces,
    each matched in backward (the gather's twin scatters dX, the scatter's twin gathers dY)."""
    config = SETTINGS[setting]
    for model_name in MODELS:
        wrong = count_mismatches(
            spans[(model_name, setting)], config, num_layers=LAYERS, sequence_parallel=True
        )
        assert not wrong, (model_name, wrong)


@pytest.mark.parametrize("setting", ["p2", "p4", "p2-k2"])
def test_collectives_overlap_other_chunks_work(spans, setting):
    """Every collective but the first and the last of each direction overlapped other work.

    The first forward all-gather (layer 0, chunk 0) has nothing to hide behind: no other chunk
    has started; its backward twin is the last collective of the backward.
    """
    config = SETTINGS[setting]
    for model_name in MODELS:
        violations = overlap_violations(
            spans[(model_name, setting)], config, sequence_parallel=True
        )
        assert not violations, (model_name, violations[:3])


def _refuses_no_backward_overlap() -> str:
    model = build_gpt_model(MODELS["layernorm-gelu-learned"])
    with pytest.raises(DominoUnsupportedError) as error:
        apply_domino(model, DominoConfig(chunks=2, backward_overlap=False))
    return str(error.value)


def test_backward_overlap_ablation_is_refused_under_sequence_parallelism():
    message = run_on_ranks(_refuses_no_backward_overlap, 2)[0]
    assert "--no-domino-backward-overlap is not supported with --sequence-parallel" in message
