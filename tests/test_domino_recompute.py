"""Domino with selective activation recompute of the core attention (``--recompute-activations``).

Megatron's ``SelfAttention`` checkpoints its core attention when ``recompute_granularity`` is
``selective`` with ``core_attn``; the schedule calls ``SelfAttention`` per chunk, so each chunk's
core attention is checkpointed on its own and recomputed in backward (with the RNG state of its
own forward, so attention dropout replays exactly). Checked on TP = 2 ranks:

* Domino with recompute against stock Megatron-Core with recompute (dropout off): loss and every
  gradient within :data:`megatron_domino.equivalence.TOLERANCES`;
* with attention dropout on, Domino with recompute against Domino without it on the same
  weights, batch and RNG seed: identical, which only holds if every chunk's recompute replays
  its own dropout mask;
* the recompute really ran: the core attention is called twice per chunk and layer (forward,
  recompute) with it, once without.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from multiproc import run_on_ranks

from megatron_domino.config import DominoConfig
from megatron_domino.equivalence import (
    compare_with_stock,
    forward_backward,
    max_abs_error,
    token_batch,
    tolerance_for,
)
from megatron_domino.gpt_model import GPTOptions, build_gpt_model
from megatron_domino.integration import apply_domino

LAYERS = 2
CHUNKS = 2
MODEL = dict(
    num_layers=LAYERS,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=16,
    vocab_size=300,
    hidden_dropout=0.0,
    recompute_granularity="selective",
)


def _against_stock() -> dict:
    options = GPTOptions(**MODEL, attention_dropout=0.0)
    comparison = compare_with_stock(
        build_gpt_model(options),
        token_batch(options, 4),
        {"p2": DominoConfig(chunks=CHUNKS), "p4": DominoConfig(chunks=4)},
        tolerance_for(options),
    )
    return {name: setting.mismatches for name, setting in comparison.settings.items()}


def test_matches_stock_megatron_with_the_same_recompute():
    mismatches = run_on_ranks(_against_stock, 2)[0]
    assert mismatches == {"p2": [], "p4": []}


def _with_and_without_recompute() -> tuple[float, list[int]]:
    """Domino with and without recompute under attention dropout: largest difference, and the
    core-attention calls per run."""
    options = GPTOptions(**MODEL, attention_dropout=0.2)
    model = build_gpt_model(options)
    batch = token_batch(options, 4)
    attentions = [layer.self_attention for layer in model.decoder.layers]
    calls = []
    for attention in attentions:
        attention.core_attention.register_forward_hook(lambda *_: calls.append(1))
    results = []
    with apply_domino(model, DominoConfig(chunks=CHUNKS)):
        for recompute in (True, False):
            for attention in attentions:
                attention.checkpoint_core_attention = recompute
            torch.manual_seed(7)
            model_parallel_cuda_manual_seed(7)
            calls.clear()
            results.append(forward_backward(model, batch))
            results[-1] = (results[-1], len(calls))
    (recomputed, recomputed_calls), (kept, kept_calls) = results
    return max_abs_error(recomputed, kept), [recomputed_calls, kept_calls]


def test_each_chunk_recomputes_its_own_dropout():
    error, calls = run_on_ranks(_with_and_without_recompute, 2)[0]
    assert calls == [2 * CHUNKS * LAYERS, CHUNKS * LAYERS]
    assert error == pytest.approx(0.0, abs=1e-7)
