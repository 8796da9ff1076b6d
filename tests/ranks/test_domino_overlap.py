"""The recorded schedule has the structure Domino promises, forward and backward.

From the event recorder of one training step (forward and backward) on TP = 2:

* the number of collectives is exactly what the schedule implies: per layer, ``2 p k``
  forward all-reduces (attention projection and fc2, ``p`` chunks, ``k`` column pieces) and,
  with backward overlap, ``2 p`` input-gradient all-reduces (QKV and fc1);
* every collective except the step's last in each direction had another chunk's (or, for
  column pieces, another piece's) compute run between its launch and its wait;
* with inter-layer overlap off, each layer waits for its last MLP all-reduce before the next
  layer starts;
* nothing is left in flight after the forward or the backward.

These are orderings, not timings, so they hold on any machine load.
"""

from __future__ import annotations

import pytest
from multiproc import run_on_ranks
from tiny_models import TINY

from lab.models.gpt_model import GPTOptions, build_gpt_model, causal_attention_mask
from megatron_domino.analysis.criteria import count_mismatches, overlap_violations
from megatron_domino.analysis.spans import collective_spans
from megatron_domino.apply import apply_domino
from megatron_domino.base.recorder import BEGIN, EventRecorder
from megatron_domino.base.settings import domino_configs

LAYERS = 3
OPTIONS = GPTOptions(num_layers=LAYERS, **TINY, num_attention_heads=4)
SETTINGS = domino_configs("p2", "p4", "p2-k2", "p1-k2", "p2-intra-layer", "p2-no-backward-overlap")


def _record_steps() -> dict:
    """On every rank: one recorded forward+backward per setting; events as plain tuples."""
    import torch

    model = build_gpt_model(OPTIONS)
    s = OPTIONS.seq_length
    tokens = torch.randint(
        0, OPTIONS.vocab_size, (4, s), generator=torch.Generator().manual_seed(0)
    )
    batch = dict(
        input_ids=tokens,
        position_ids=torch.arange(s).expand(4, s),
        attention_mask=causal_attention_mask(s, "cpu"),
        labels=tokens,
    )
    recorded = {}
    for name, config in SETTINGS.items():
        recorder = EventRecorder()
        with apply_domino(model, config, recorder=recorder) as handle:
            loss = model(**batch).mean()
            pending_after_forward = (
                len(handle.runtime.last_step.pending_forward),
                len(handle.runtime.last_step.pending_backward),
            )
            loss.backward()
            pending_after_backward = len(handle.runtime.last_step.pending_backward)
        recorded[name] = dict(
            events=recorder.events(),
            after_forward=pending_after_forward,
            after_backward=pending_after_backward,
        )
    return recorded


@pytest.fixture(scope="module")
def recorded():
    return run_on_ranks(_record_steps, 2)[0]


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_collective_counts_and_nothing_pending(recorded, name):
    spans = collective_spans(recorded[name]["events"])
    config = SETTINGS[name]
    assert not count_mismatches(
        spans, config, num_layers=LAYERS, sequence_parallel=False, embedding=True, output_layer=True
    )
    assert recorded[name]["after_forward"] == (0, 0)
    assert recorded[name]["after_backward"] == 0


@pytest.mark.parametrize("name", ["p2", "p4", "p2-k2"])
def test_every_collective_but_the_last_overlaps_other_chunks_compute(recorded, name):
    spans = collective_spans(recorded[name]["events"])
    violations = overlap_violations(spans, SETTINGS[name], sequence_parallel=False)
    assert not violations, violations[:3]


def test_column_pieces_overlap_the_next_piece_at_one_chunk(recorded):
    """At p = 1 the column split is the only overlap: piece 0 flies during piece 1's GEMM."""
    spans = collective_spans(recorded["p1-k2"]["events"])
    assert any(s.piece == 0 for s in spans)
    violations = overlap_violations(spans, SETTINGS["p1-k2"], sequence_parallel=False)
    assert not violations, violations[:3]


def test_intra_layer_mode_drains_each_layer(recorded):
    """Without inter-layer overlap no layer starts before the previous one's MLP all-reduces end."""
    events = recorded["p2-intra-layer"]["events"]
    spans = collective_spans(events)
    for layer in range(1, LAYERS):
        last_wait = max(
            s.wait_end_s
            for s in spans
            if s.direction == "fwd" and s.layer == layer - 1 and s.name == "mlp_ar"
        )
        first_start = min(
            e.time_s
            for e in events
            if e.kind == BEGIN and e.direction == "fwd" and e.layer == layer
        )
        assert last_wait <= first_start


def test_inter_layer_mode_carries_the_mlp_all_reduce_into_the_next_layer(recorded):
    events = recorded["p2"]["events"]
    spans = collective_spans(events)
    carried = [
        s
        for s in spans
        if s.direction == "fwd"
        and s.name == "mlp_ar"
        and s.layer < LAYERS - 1
        and any(region[1] == s.layer + 1 for region in s.overlapped_by)
    ]
    assert len(carried) == LAYERS - 1
