"""The sequence split on Transformer Engine's own layers at micro-batch 1 (TE 2.18's Python on the CPU).

Megatron-LM's largest models train with TE layers, ``--sequence-parallel`` and micro-batch 1,
where the batch split has nothing to split and TE refuses column pieces. The sequence split
runs there: each rank builds a TP = 2 model of real TE modules (:mod:`te_models`: Megatron's
TE spec without SP, the norms-apart spec under it, both with ``TEDotProductAttention``, which
runs TE's unfused attention backend here, :mod:`te_cpu`), runs a forward and backward with the
stock block at micro-batch 1, then with ``--domino-split sequence`` (with SP: chunk-major
layout, backward overlap; without SP: ``--no-domino-backward-overlap``, as TE requires there),
and compares the per-token loss and every gradient (SP parameters' gradients summed over TP
first, as ``finalize_model_grads`` does; fp32 ``atol = 1e-6, rtol = 1e-5``). It also checks the
mask type each chunk's attention call passed to TE (read from TE's ``DotProductAttention``,
:class:`te_models.TECalls`), the collectives the recorder saw, TE's own alignment of its causal
mask types, and the refusal of a TE attention that takes its mask type only at construction.

What this does not show: that TE's GPU backends (flash, cuDNN) agree with its unfused one on
``causal_bottom_right`` (``tests/gpu/test_transformer_engine_gpu.py``'s ``bf16-sp-seq`` case and
the GPU check run that).
"""

from __future__ import annotations

import pytest
import torch
from allocations import BoolTensors
from multiproc import run_on_ranks
from te_models import LAYERS, AttentionCall, TECalls, te_options, te_spec

from lab.analysis.equivalence import (
    compare_with_stock,
    forward_backward,
    mismatches,
    token_batch,
    tolerance_for,
)
from lab.models.gpt_model import build_gpt_model
from megatron_domino.analysis.criteria import count_mismatches, overlap_violations
from megatron_domino.apply import apply_domino
from megatron_domino.base.config import DominoConfig, DominoUnsupportedError
from megatron_domino.base.settings import setting

pytestmark = pytest.mark.te

#: The settings (names: megatron_domino.base.settings), all at micro-batch 1.
SETTINGS = [setting(name) for name in ("sp-s2", "sp-s4", "s2-no-backward-overlap")]


def _compare() -> dict:
    """On every rank, for each SP mode: each setting against the stock block."""
    found = {"revert": []}
    for sequence_parallel in (True, False):
        sp = sequence_parallel
        options = te_options(sp)
        model = build_gpt_model(options, spec=te_spec(sp))
        batch = token_batch(options, 1)
        settings = {n.name: n.config for n in SETTINGS if n.sequence_parallel == sp}
        with TECalls(model) as calls:
            comparison = compare_with_stock(
                model, batch, settings, tolerance_for(options), record=True, observe=calls.take
            )
        for name, compared in comparison.settings.items():
            config = settings[name]
            found[name] = dict(
                mismatches=compared.mismatches[:3],
                pending=compared.left_pending,
                counts=count_mismatches(
                    compared.spans,
                    config,
                    num_layers=LAYERS,
                    sequence_parallel=sp,
                    embedding=not sp,
                    output_layer=not sp,
                ),
                overlap=(
                    overlap_violations(compared.spans, config, sequence_parallel=sp)[:3]
                    if config.inter_layer
                    else []
                ),
                calls=[c for c in compared.observed if c and isinstance(c[0], AttentionCall)],
            )
        found["revert"].append(comparison.revert_error)
        if sequence_parallel:
            reference = forward_backward(model, batch, finalize_sequence_parallel=True)
            found["no_mask"] = _without_a_mask(model, batch, reference, options)
    found["alignment"] = _te_causal_alignment()
    # A TE that takes the mask type only at construction (< 0.12) would run "causal" (top-left).
    model.decoder.layers[0].self_attention.core_attention.te_forward_mask_type = False
    with pytest.raises(DominoUnsupportedError) as refused:
        apply_domino(model, DominoConfig(chunks=2, split_along="sequence"))
    found["refused"] = str(refused.value)
    return found


def _without_a_mask(model, batch, reference, options) -> dict:
    """The sequence split under SP with no attention mask (causal): the boolean ``[s, s]``
    tensors created in forward and backward (a dense mask), and
    the loss and gradients against stock's (TE's ``causal`` reads no mask)."""
    s = options.seq_length
    with apply_domino(model, DominoConfig(chunks=2, split_along="sequence")):
        with BoolTensors(s) as created:
            result = forward_backward(
                model, {**batch, "attention_mask": None}, finalize_sequence_parallel=True
            )
    return dict(
        created=created.found, mismatches=mismatches(result, reference, tolerance_for(options))
    )


@pytest.fixture(scope="module")
def compared():
    return run_on_ranks(_compare, 2, te=True)[0]


def test_matches_stock_te_at_micro_batch_1(compared):
    """Loss and gradients as stock TE's, nothing left in flight, the schedule's collectives
    counted and (with inter-layer overlap) overlapped as under the batch split; the revert
    restores stock exactly."""
    assert compared["revert"] == [0.0, 0.0]
    for named in SETTINGS:
        checked = {
            name: compared[named.name][name]
            for name in ("mismatches", "pending", "counts", "overlap")
        }
        assert checked == dict(mismatches=[], pending=0, counts=[], overlap=[]), named.name


def test_later_chunks_ask_te_for_a_bottom_right_causal_mask(compared):
    """Per layer, chunk 0 calls TE as stock does (``causal``, its square mask rows); chunk
    ``c > 0`` has ``s/p`` queries against ``(c+1)s/p`` keys and passes
    ``causal_bottom_right`` with no mask tensor (TE's ``causal`` would be aligned top-left)."""
    s = te_options(False).seq_length
    for named in SETTINGS:
        key, p = named.name, named.config.chunks
        q = s // p
        expected = [AttentionCall("causal", q, q, True)]
        expected += [
            AttentionCall("causal_bottom_right", q, (c + 1) * q, False) for c in range(1, p)
        ]
        assert compared[key]["calls"] == [expected] * LAYERS, key


def test_no_dense_mask_is_built_for_te_attention(compared):
    """Without a mask (causal) TE's attention reads none, so the sequence split builds none:
    no ``[s, s]`` boolean tensor (``s**2`` bytes, 1 GiB at s = 32k) is created in the block's
    forward or backward, and loss and gradients stay stock's."""
    assert compared["no_mask"] == dict(created=[], mismatches=[])


def _te_causal_alignment() -> dict:
    """TE's ``DotProductAttention`` (its unfused backend here) on the last 3 of 8 queries with
    ``causal_bottom_right`` and with ``causal``, against the rows of the full causal attention."""
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    attention = te.DotProductAttention(2, 4, qkv_format="sbhd", attn_mask_type="causal")
    query, key, value = (torch.randn(8, 1, 2, 4) for _ in range(3))
    full = attention(query, key, value, attn_mask_type="causal")
    return {
        mask_type: torch.equal(attention(query[5:], key, value, attn_mask_type=mask_type), full[5:])
        for mask_type in ("causal_bottom_right", "causal")
    }


def test_te_aligns_causal_masks_as_the_split_needs(compared):
    """What the split relies on, from TE itself: for the last ``sq`` of ``sk`` queries,
    ``causal_bottom_right`` gives the rows of the full causal attention, and plain ``causal``
    (aligned top-left) does not."""
    assert compared["alignment"] == {"causal_bottom_right": True, "causal": False}


def test_a_te_without_per_call_mask_types_is_refused(compared):
    assert (
        "layer 0: --domino-split sequence needs Transformer Engine's attention to take the "
        "mask type per call (TE >= 0.12)" in compared["refused"]
    )
