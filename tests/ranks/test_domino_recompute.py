"""Domino with activation recompute: selective (core attention) and full (ranges of layers).

* **Selective** (``--recompute-activations``): Megatron's ``SelfAttention`` checkpoints its
  core attention; the schedule calls ``SelfAttention`` per chunk, so each chunk's core
  attention is checkpointed and recomputed on its own.
* **Full** (``--recompute-granularity full``): Domino runs the layer ranges Megatron-Core
  checkpoints (``uniform`` groups, or ``block``: the first layers one by one) each as one
  Domino step inside Megatron's ``checkpoint``, and replays that step in backward.

Checked on TP = 2 ranks (four layers: ``uniform`` with 2 gives two ranges of two layers, which
Megatron requires to divide the layers; ``block`` with 2 leaves two layers unrecomputed), for
each recompute setting:

* Domino against stock Megatron-Core with the same recompute (dropout off): loss and every
  gradient within :data:`lab.analysis.equivalence.TOLERANCES`, p = 2 and 4 (and, with
  full recompute, the sequence split, whose replay rebuilds its key cache);
* with attention and hidden dropout on, Domino with the recompute against Domino without it, on
  the same weights, batch and RNG seed: identical, which holds only if every replay draws the
  dropout masks its forward drew;
* the recompute really ran: every core attention is called twice per chunk (forward and
  replay) where it is recomputed, once elsewhere.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from multiproc import run_on_ranks
from tiny_models import TINY

from lab.analysis.equivalence import (
    compare_with_stock,
    forward_backward,
    max_abs_error,
    token_batch,
    tolerance_for,
)
from lab.models.gpt_model import GPTOptions, build_gpt_model
from megatron_domino.apply import apply_domino
from megatron_domino.base.config import DominoConfig, DominoUnsupportedError

LAYERS = 4
CHUNKS = 2
MODEL = dict(num_layers=LAYERS, **TINY, num_attention_heads=4)
#: setting -> (GPTOptions recompute fields, layers whose core attention is recomputed)
RECOMPUTE = {
    "selective-core-attn": (dict(recompute_granularity="selective"), LAYERS),
    "full-uniform-1": (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        LAYERS,
    ),
    "full-uniform-2": (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
        LAYERS,
    ),
    "full-block-2": (
        dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
        2,
    ),
}


def _options(setting: str, dropout: float) -> GPTOptions:
    fields, _ = RECOMPUTE[setting]
    return GPTOptions(
        **{**MODEL, **fields, "attention_dropout": dropout, "hidden_dropout": dropout}
    )


def _against_stock(setting: str) -> dict:
    options = _options(setting, 0.0)
    configs = {"p2": DominoConfig(chunks=CHUNKS), "p4": DominoConfig(chunks=4)}
    if setting.startswith("full"):  # the sequence split's key cache must survive the replay
        configs["s2"] = DominoConfig(chunks=CHUNKS, split_along="sequence")
    comparison = compare_with_stock(
        build_gpt_model(options), token_batch(options, 4), configs, tolerance_for(options)
    )
    return {name: result.mismatches for name, result in comparison.settings.items()}


@pytest.mark.parametrize("setting", sorted(RECOMPUTE))
def test_matches_stock_megatron_with_the_same_recompute(setting):
    found = run_on_ranks(_against_stock, 2, args=(setting,))[0]
    assert found == dict.fromkeys(found, [])
    assert len(found) == (3 if setting.startswith("full") else 2)


def _with_and_without_recompute(setting: str) -> tuple[float, list[int]]:
    """Domino with and without the recompute under dropout: largest difference, and the
    core-attention calls of each run."""
    options = _options(setting, 0.2)
    model = build_gpt_model(options)
    batch = token_batch(options, 4)
    calls = []
    for layer in model.decoder.layers:
        layer.self_attention.core_attention.register_forward_hook(lambda *_: calls.append(1))
    config, attentions = model.config, [layer.self_attention for layer in model.decoder.layers]
    recompute = (config.recompute_granularity, [a.checkpoint_core_attention for a in attentions])
    results = []
    with apply_domino(model, DominoConfig(chunks=CHUNKS)):
        for on in (True, False):
            config.recompute_granularity = recompute[0] if on else None
            for attention, checkpointed in zip(attentions, recompute[1], strict=True):
                attention.checkpoint_core_attention = checkpointed and on
            torch.manual_seed(7)
            model_parallel_cuda_manual_seed(7)
            calls.clear()
            results.append((forward_backward(model, batch), len(calls)))
    (recomputed, recomputed_calls), (kept, kept_calls) = results
    return max_abs_error(recomputed, kept), [recomputed_calls, kept_calls]


@pytest.mark.parametrize("setting", sorted(RECOMPUTE))
def test_replays_draw_the_same_dropout(setting):
    error, calls = run_on_ranks(_with_and_without_recompute, 2, args=(setting,))[0]
    _, recomputed_layers = RECOMPUTE[setting]
    assert calls == [CHUNKS * (LAYERS + recomputed_layers), CHUNKS * LAYERS]
    assert error == pytest.approx(0.0, abs=1e-7)


def _refused_mlp_recompute() -> str:
    options = GPTOptions(**MODEL, recompute_granularity="selective", recompute_modules=("mlp",))
    with pytest.raises(DominoUnsupportedError) as error:
        apply_domino(build_gpt_model(options), DominoConfig(chunks=CHUNKS))
    return str(error.value)


def test_selective_recompute_of_the_mlp_is_refused():
    assert (
        "selective recompute of mlp is not supported" in run_on_ranks(_refused_mlp_recompute, 2)[0]
    )
