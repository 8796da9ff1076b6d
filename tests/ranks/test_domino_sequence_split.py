"""``--domino-split sequence``: chunks of tokens, equal to stock Megatron-Core at micro-batch 1.

Each rank builds one TP = 2 model per family, runs a forward and backward with the stock block
at micro-batch 1 and 2, then with Domino splitting the sequence for each setting, and compares
the per-token loss and every gradient (:func:`lab.analysis.equivalence.compare_with_stock`,
fp32 ``atol = 1e-6, rtol = 1e-5``). Learned absolute positions (added before the block) and
rotary embeddings (sliced per chunk inside it) are both covered, as is grouped-query attention
(earlier chunks' keys are concatenated before the key/value heads are expanded).

The recorder must show the same collectives as the batch split (``2 p k`` forward all-reduces
and ``2 p`` backward ones per layer) and, with inter-layer overlap, every collective but each
pass's last overlapping another chunk's work: chunk ``c``'s attention waits only for chunks
``0..c-1``'s keys, which the wavefront computed before.

Under sequence parallelism (chunk-major layout, :mod:`megatron_domino.engine.chunking`) the same
comparison runs with the gradients of ``sequence_parallel`` parameters (norms, row-linear
biases) summed over TP first: each rank's share of the tokens differs from stock's, only the
sum ``finalize_model_grads`` forms is the same.

With ``--masked-softmax-fusion`` (Megatron-LM's default) in bf16, Megatron's fused softmax
runs CPU stand-ins of its CUDA kernels (``tests/fused_softmax_stand_in.py``), so it takes the
path a GPU would take for each chunk's shapes: the test checks which kernel each chunk ran
(never the square-only causal kernel for ``sq != sk``), with which mask rows, and that loss
and gradients stay within the bf16 bound of stock's (fused causal kernel) own error.
"""

from __future__ import annotations

import dataclasses

import fused_softmax_stand_in
import pytest
import torch
from allocations import BoolTensors
from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
from multiproc import run_on_ranks
from tiny_models import LLAMA_STYLE, TINY

from lab.analysis.equivalence import (
    compare_with_stock,
    forward_backward,
    fp32_reference_model,
    max_abs_error,
    token_batch,
    tolerance_for,
)
from lab.models.gpt_model import GPTOptions, build_gpt_model, causal_attention_mask
from megatron_domino.analysis.criteria import count_mismatches, overlap_violations
from megatron_domino.analysis.spans import collective_spans
from megatron_domino.apply import apply_domino
from megatron_domino.base.config import DominoConfig
from megatron_domino.base.recorder import EventRecorder
from megatron_domino.base.settings import domino_configs
from megatron_domino.engine.chunk_attention import causal_rows

LAYERS = 2
MODELS = {
    "layernorm-gelu-learned": GPTOptions(num_layers=LAYERS, **TINY, num_attention_heads=4),
    "rmsnorm-swiglu-rope-gqa": GPTOptions(num_layers=LAYERS, **LLAMA_STYLE),
}
SETTINGS = domino_configs("s2", "s4", "s2-k2", "s2-intra-layer", "s2-no-backward-overlap")


def _compare(micro_batch: int) -> dict:
    found = {}
    for model_name, options in MODELS.items():
        model = build_gpt_model(options)
        comparison = compare_with_stock(
            model, token_batch(options, micro_batch), SETTINGS, tolerance_for(options)
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
    for setting, config in SETTINGS.items():
        recorder = EventRecorder()
        with apply_domino(model, config, recorder=recorder):
            model(**batch).float().mean().backward()
        spans[setting] = collective_spans(recorder.events())
    return spans


def test_collectives_match_the_schedule_and_overlap():
    spans = run_on_ranks(_spans, 2)[0]
    for setting, config in SETTINGS.items():
        wrong = count_mismatches(
            spans[setting],
            config,
            num_layers=LAYERS,
            sequence_parallel=False,
            embedding=True,
            output_layer=True,
        )
        assert not wrong, (setting, wrong)
        if config.inter_layer:
            violations = overlap_violations(spans[setting], config, sequence_parallel=False)
            assert not violations, (setting, violations[:3])


def _without_a_mask() -> dict:
    """Domino's sequence split with no attention mask (Megatron then means causal) against the
    same with the explicit causal mask; the boolean ``[s, s]`` tensors the former created, and
    the masks its softmax calls got in two forwards."""
    options = MODELS["rmsnorm-swiglu-rope-gqa"]
    model = build_gpt_model(options)
    batch = token_batch(options, 1)
    implicit_batch = {**batch, "attention_mask": None}
    causal_rows.cache_clear()
    with apply_domino(model, DominoConfig(chunks=4, split_along="sequence")):
        explicit = forward_backward(model, batch)
        with BoolTensors(options.seq_length) as created:
            implicit = forward_backward(model, implicit_batch)
        with fused_softmax_stand_in.installed():
            calls = _softmax_calls(model, implicit_batch) + _softmax_calls(model, implicit_batch)
    return dict(
        error=max_abs_error(implicit, explicit),
        created=created.found,
        masks=[(c.sq, c.sk, c.mask) for c in calls],
        built=causal_rows.cache_info().misses,
    )


def test_a_missing_mask_means_causal():
    """No mask: the same loss and gradients as with the explicit causal mask, without building
    it (no ``[s, s]`` boolean tensor): each chunk's softmax gets the causal mask's rows for its
    queries, built once per shape (three forwards, two layers, four chunks: four builds)."""
    found = run_on_ranks(_without_a_mask, 2)[0]
    assert found["error"] == 0.0
    assert found["created"] == []
    s, p = MODELS["rmsnorm-swiglu-rope-gqa"].seq_length, 4
    q, stock = s // p, causal_attention_mask(s, "cpu")
    masks = found["masks"]
    assert [(sq, sk) for sq, sk, _ in masks] == [(q, (c + 1) * q) for c in range(p)] * 2 * LAYERS
    for index, (_, sk, mask) in enumerate(masks):
        c = index % p
        assert torch.equal(mask, stock[..., c * q : (c + 1) * q, :sk]), c
    assert found["built"] == p


SP_SETTINGS = domino_configs("sp-s2", "sp-s4")


def _compare_under_sequence_parallelism() -> dict:
    options = dataclasses.replace(MODELS["rmsnorm-swiglu-rope-gqa"], sequence_parallel=True)
    model = build_gpt_model(options)
    comparison = compare_with_stock(
        model, token_batch(options, 1), SP_SETTINGS, tolerance_for(options), record=True
    )
    found = {}
    for setting, config in SP_SETTINGS.items():
        compared = comparison.settings[setting]
        found[setting] = dict(
            mismatches=compared.mismatches,
            pending=compared.left_pending,
            counts=count_mismatches(
                compared.spans, config, num_layers=LAYERS, sequence_parallel=True
            ),
            overlap=overlap_violations(compared.spans, config, sequence_parallel=True)[:3],
        )
    found["revert"] = comparison.revert_error
    return found


def test_matches_stock_under_sequence_parallelism():
    """Micro-batch 1 with --sequence-parallel: loss and gradients as stock's, every collective
    of the schedule counted and overlapped as under the batch split."""
    found = run_on_ranks(_compare_under_sequence_parallelism, 2)[0]
    assert found.pop("revert") == 0.0
    for setting, result in found.items():
        assert result == dict(mismatches=[], pending=0, counts=[], overlap=[]), setting


#: bf16 with Megatron-LM's default fused softmax: 16 heads (8 per TP rank) and s = 64, so the
#: fused kernels' shape conditions hold for the whole sequence and for most chunks.
FUSED = GPTOptions(
    num_layers=LAYERS, **{**LLAMA_STYLE, "seq_length": 64, "num_attention_heads": 16}, bf16=True
)


def _document_mask(s: int) -> torch.Tensor:
    """A causal mask that also separates two documents of ``s/2`` tokens (as
    ``--reset-attention-mask`` makes them): ``[1, 1, s, s]``, True where masked."""
    mask = torch.ones(s, s, dtype=torch.bool).triu(diagonal=1)
    mask[s // 2 :, : s // 2] = True
    return mask.view(1, 1, s, s)


def _softmax_calls(model, batch, config=None) -> list:
    """The softmax calls of one forward (Domino's with ``config``), as recorded."""
    fused_softmax_stand_in.CALLS.clear()
    with torch.no_grad():
        if config is None:
            model(**batch)
        else:
            with apply_domino(model, config):
                model(**batch)
    return list(fused_softmax_stand_in.CALLS)


def _bottom_right_causal(sq: int, sk: int) -> torch.Tensor:
    return torch.ones(sq, sk, dtype=torch.bool).triu(diagonal=sk - sq + 1).view(1, 1, sq, sk)


def _under_fused_softmax() -> dict:
    options = FUSED
    model = build_gpt_model(options)
    softmaxes = [m for m in model.modules() if isinstance(m, FusedScaleMaskSoftmax)]
    for softmax in softmaxes:  # built off on the CPU, where the kernels do not exist
        softmax.scaled_masked_softmax_fusion = True
    batch = token_batch(options, 1)
    configs = domino_configs("s2", "s4")
    found = {}
    with fused_softmax_stand_in.installed():
        comparison = compare_with_stock(
            model,
            batch,
            configs,
            tolerance_for(options),
            fp32_reference=fp32_reference_model(options, model),
        )
        found["passed"] = {name: row.passed for name, row in comparison.settings.items()}
        found["mismatches"] = [m for row in comparison.settings.values() for m in row.mismatches]
        calls = {"stock": _softmax_calls(model, batch)}
        calls |= {name: _softmax_calls(model, batch, config) for name, config in configs.items()}
        found["kernels"] = {
            name: [(c.kernel, c.sq, c.sk) for c in found_calls]
            for name, found_calls in calls.items()
        }
        found["causal_rows"] = all(
            torch.equal(c.mask, _bottom_right_causal(c.sq, c.sk)) for c in calls["s2"]
        )
        # The stock fused kernel ignores a document mask (causal only): so must the chunks.
        documents = {**batch, "attention_mask": _document_mask(options.seq_length)}
        fused = _softmax_calls(model, documents, configs["s2"])
        found["documents_fused"] = [
            torch.equal(c.mask, _bottom_right_causal(c.sq, c.sk)) for c in fused
        ]
        # Without the fusion stock's torch softmax applies it: so do the chunks, row for row.
        for softmax in softmaxes:
            softmax.scaled_masked_softmax_fusion = False
        unfused = _softmax_calls(model, documents, configs["s2"])
        rows = [
            documents["attention_mask"][..., c * 32 : (c + 1) * 32, : (c + 1) * 32] for c in (0, 1)
        ]
        found["documents_unfused"] = [
            (c.kernel, torch.equal(c.mask, rows[i % 2])) for i, c in enumerate(unfused)
        ]
    return found


def test_fused_softmax_runs_the_masked_kernel_with_each_chunks_rows():
    """bf16 with --masked-softmax-fusion: stock runs the fused causal kernel on [s, s]; each
    chunk runs the fused masked kernel where its shapes allow it (else the torch softmax) with
    its causal rows, never the square-only causal kernel on sq != sk (which asserts, and under
    python -O would mask the wrong keys), and matches stock within the bf16 bound."""
    found = run_on_ranks(_under_fused_softmax, 2)[0]
    assert found["passed"] == {"s2": True, "s4": True}, found["mismatches"][:3]
    per_layer = {
        "stock": [("upper_triang", 64, 64)],
        "s2": [("masked", 32, 32), ("masked", 32, 64)],
        # chunk 0's 16 keys are too few for the kernel (it needs 16 < sk): the torch softmax.
        "s4": [("torch", 16, 16), ("masked", 16, 32), ("masked", 16, 48), ("masked", 16, 64)],
    }
    assert found["kernels"] == {name: calls * LAYERS for name, calls in per_layer.items()}
    assert found["causal_rows"]
    assert found["documents_fused"] == [True] * 2 * LAYERS
    assert found["documents_unfused"] == [("torch", True)] * 2 * LAYERS
