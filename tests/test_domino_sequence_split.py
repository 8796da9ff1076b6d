"""``--domino-split sequence``: chunks of tokens, equal to stock Megatron-Core at micro-batch 1.

Each rank builds one TP = 2 model per family, runs a forward and backward with the stock block
at micro-batch 1 and 2, then with Domino splitting the sequence for each setting, and compares
the per-token loss and every gradient (:func:`megatron_domino.equivalence.compare_with_stock`,
fp32 ``atol = 1e-6, rtol = 1e-5``). Learned absolute positions (added before the block) and
rotary embeddings (sliced per chunk inside it) are both covered, as is grouped-query attention
(earlier chunks' keys are concatenated before the key/value heads are expanded).

The recorder must show the same collectives as the batch split (``2 p k`` forward all-reduces
and ``2 p`` backward ones per layer) and, with inter-layer overlap, every collective but each
pass's last overlapping another chunk's work: chunk ``c``'s attention waits only for chunks
``0..c-1``'s keys, which the wavefront computed before.
"""

from __future__ import annotations

import pytest
from multiproc import run_on_ranks
from tiny_models import LLAMA_STYLE, TINY

from megatron_domino.config import DominoConfig, DominoUnsupportedError
from megatron_domino.equivalence import (
    compare_with_stock,
    forward_backward,
    max_abs_error,
    token_batch,
    tolerance_for,
)
from megatron_domino.gpt_model import GPTOptions, build_gpt_model
from megatron_domino.integration import apply_domino
from megatron_domino.overlap import collective_spans
from megatron_domino.recorder import EventRecorder
from megatron_domino.schedule_checks import count_mismatches, overlap_violations

LAYERS = 2
MODELS = {
    "layernorm-gelu-learned": GPTOptions(num_layers=LAYERS, **TINY, num_attention_heads=4),
    "rmsnorm-swiglu-rope-gqa": GPTOptions(num_layers=LAYERS, **LLAMA_STYLE),
}
SETTINGS = {
    "p2": dict(chunks=2),
    "p4": dict(chunks=4),
    "p2-k2": dict(chunks=2, column_chunks=2),
    "p2-intra-layer": dict(chunks=2, inter_layer=False),
    "p2-no-backward-overlap": dict(chunks=2, backward_overlap=False),
}


def _configs() -> dict[str, DominoConfig]:
    return {
        name: DominoConfig(split_along="sequence", **kwargs) for name, kwargs in SETTINGS.items()
    }


def _compare(micro_batch: int) -> dict:
    found = {}
    for model_name, options in MODELS.items():
        model = build_gpt_model(options)
        comparison = compare_with_stock(
            model, token_batch(options, micro_batch), _configs(), tolerance_for(options)
        )
        assert comparison.reverted
        for setting, result in comparison.settings.items():
            found[(model_name, setting)] = (result.mismatches, result.left_pending)
    return found


@pytest.mark.parametrize("micro_batch", [1, 2])
def test_matches_stock_megatron(micro_batch):
    found = run_on_ranks(_compare, 2, args=(micro_batch,))[0]
    assert found == {key: ([], 0) for key in found}
    assert len(found) == len(MODELS) * len(SETTINGS)


def _spans() -> dict:
    options = MODELS["rmsnorm-swiglu-rope-gqa"]
    model = build_gpt_model(options)
    batch = token_batch(options, 1)
    spans = {}
    for setting, config in _configs().items():
        recorder = EventRecorder()
        with apply_domino(model, config, recorder=recorder):
            model(**batch).float().mean().backward()
        spans[setting] = collective_spans(recorder.events())
    return spans


def test_collectives_match_the_schedule_and_overlap():
    spans = run_on_ranks(_spans, 2)[0]
    for setting, config in _configs().items():
        wrong = count_mismatches(spans[setting], config, num_layers=LAYERS, sequence_parallel=False)
        assert not wrong, (setting, wrong)
        if config.inter_layer:
            violations = overlap_violations(spans[setting], config, sequence_parallel=False)
            assert not violations, (setting, violations[:3])


def _without_a_mask() -> float:
    """Domino's sequence split with no attention mask (Megatron then means causal) against the
    same with the explicit causal mask."""
    options = MODELS["rmsnorm-swiglu-rope-gqa"]
    model = build_gpt_model(options)
    batch = token_batch(options, 1)
    with apply_domino(model, DominoConfig(chunks=4, split_along="sequence")):
        explicit = forward_backward(model, batch)
        implicit = forward_backward(model, {**batch, "attention_mask": None})
    return max_abs_error(implicit, explicit)


def test_a_missing_mask_means_causal():
    assert run_on_ranks(_without_a_mask, 2)[0] == 0.0


def _refused_with_sequence_parallel() -> str:
    options = GPTOptions(num_layers=LAYERS, **TINY, num_attention_heads=4, sequence_parallel=True)
    with pytest.raises(DominoUnsupportedError) as error:
        apply_domino(build_gpt_model(options), DominoConfig(chunks=2, split_along="sequence"))
    return str(error.value)


def test_sequence_parallelism_is_refused():
    message = run_on_ranks(_refused_with_sequence_parallel, 2)[0]
    assert "--domino-split sequence cannot run with --sequence-parallel" in message
