"""The sequence split on Transformer Engine layers at micro-batch 1, checked on the CPU.

Megatron-LM's largest models train with TE layers, ``--sequence-parallel`` and micro-batch 1,
where the batch split has nothing to split and TE refuses column pieces. The sequence split
runs there: each rank builds a TP = 2 model from Megatron's TE layer spec shape with the
stand-ins of :mod:`te_stand_in` for TE's linears *and* its attention
(``stand_in_te_layer_spec(te_attention=True)``, which keeps TE's mask-type semantics: plain
``causal`` is aligned top-left), runs a forward and backward with the stock block at
micro-batch 1, then with ``--domino-split sequence`` (with SP: chunk-major layout, backward
overlap; without SP: ``--no-domino-backward-overlap``, as TE requires there), and compares the
per-token loss and every gradient (SP parameters' gradients summed over TP first, as
``finalize_model_grads`` does; fp32 ``atol = 1e-6, rtol = 1e-5``). It also checks the mask
type each chunk's attention call passed to TE, the collectives the recorder saw, and the
refusal of a TE attention that takes its mask type only at construction.

What this does not show: that real TE's backends agree with the stand-in on
``causal_bottom_right`` (``tests/gpu/test_transformer_engine_gpu.py``'s ``bf16-sp-seq`` case and
the GPU check run that).
"""

from __future__ import annotations

import functools

import pytest
import torch
from allocations import BoolTensors
from multiproc import run_on_ranks
from te_stand_in import (
    AttentionCall,
    attention_context,
    stand_in_attentions,
    stand_in_te_layer_spec,
    stand_in_te_norms_apart_layer_spec,
    take_calls,
    te_attention_probs,
)
from tiny_models import LLAMA_STYLE

from megatron_domino.analysis.criteria import count_mismatches, overlap_violations
from megatron_domino.analysis.equivalence import (
    compare_with_stock,
    forward_backward,
    mismatches,
    token_batch,
    tolerance_for,
)
from megatron_domino.apply import apply_domino
from megatron_domino.config import DominoConfig, DominoUnsupportedError
from megatron_domino.harness.gpt_model import GPTOptions, build_gpt_model
from megatron_domino.harness.settings import setting

LAYERS = 2
#: The settings (names: megatron_domino.harness.settings), all at micro-batch 1.
SETTINGS = [setting(name) for name in ("sp-s2", "sp-s4", "s2-no-backward-overlap")]


def _compare() -> dict:
    """On every rank, for each SP mode: each setting against the stock block."""
    found = {"revert": []}
    for sequence_parallel in (True, False):
        sp = sequence_parallel
        options = GPTOptions(num_layers=LAYERS, **LLAMA_STYLE, sequence_parallel=sp)
        spec = stand_in_te_norms_apart_layer_spec if sp else stand_in_te_layer_spec
        model = build_gpt_model(options, spec=spec(te_attention=True))
        attentions = stand_in_attentions(model)
        batch = token_batch(options, 1)
        settings = {n.name: n.config for n in SETTINGS if n.sequence_parallel == sp}
        comparison = compare_with_stock(
            model,
            batch,
            settings,
            tolerance_for(options),
            record=True,
            observe=functools.partial(take_calls, attentions),
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
                calls=compared.observed,
            )
        found["revert"].append(comparison.revert_error)
        if sequence_parallel:
            reference = forward_backward(model, batch, finalize_sequence_parallel=True)
            found["no_mask"] = _without_a_mask(model, batch, reference, options)
    # A TE that takes the mask type only at construction (< 0.12) would run "causal" (top-left).
    attentions[0].te_forward_mask_type = False
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
    return run_on_ranks(_compare, 2)[0]


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
    s = LLAMA_STYLE["seq_length"]
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


def test_the_stand_in_aligns_causal_masks_as_te_does():
    """What the check above relies on: for the last ``sq`` of ``sk`` queries,
    ``causal_bottom_right`` gives the rows of the full causal attention, and plain ``causal``
    (top-left) does not."""
    torch.manual_seed(0)
    query, key, value = (torch.randn(8, 1, 2, 4) for _ in range(3))
    scale = 0.5

    def attend(q, mask_type):
        return attention_context(
            te_attention_probs(q, key, None, mask_type, softmax_scale=scale), value
        )

    full = attend(query, "causal")
    torch.testing.assert_close(attend(query[5:], "causal_bottom_right"), full[5:])
    assert not torch.allclose(attend(query[5:], "causal"), full[5:])


def test_a_te_without_per_call_mask_types_is_refused(compared):
    assert (
        "layer 0: --domino-split sequence needs Transformer Engine's attention to take the "
        "mask type per call (TE >= 0.12)" in compared["refused"]
    )
