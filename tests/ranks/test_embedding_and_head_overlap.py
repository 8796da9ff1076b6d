"""The model's two ends under Domino: the embedding's all-reduce launched per chunk and waited
by each chunk's first op, and the output layer's input gradient all-reduced per chunk and
waited inside the block.

One launch of two ranks checks, on the tied-embedding GPT shape (learned positions) and the
untied Llama shape (RoPE):

* equivalence with stock Megatron-Core (loss and every gradient, the output and embedding
  weights included) for the batch split (p = 2, 4, with column pieces) and the sequence split;
* the recorded step: ``p`` embedding all-reduces, the forward's first launches, chunk 0 first,
  each but chunk 0's flying while an earlier chunk's first ops ran; each chunk's logits
  computed inside the schedule while the next chunk's last MLP all-reduce flies (after its
  launch, before its wait); ``p`` output-layer all-reduces, the backward's first launches, last
  chunk first, each but the last chunk's flying while another chunk's backward ran;
* where the ends stay stock: sequence parallelism, one chunk, (output layer) backward overlap
  off;
* a block output that never reaches the output layer (the hand-off not taken) still trains.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from multiproc import run_on_ranks
from tiny_models import LLAMA_STYLE, TINY

from lab.analysis.equivalence import compare_with_stock, token_batch, tolerance_for
from lab.models.gpt_model import GPTOptions, build_gpt_model
from megatron_domino.analysis.spans import collective_spans
from megatron_domino.apply import apply_domino
from megatron_domino.base.recorder import EventRecorder
from megatron_domino.base.settings import domino_configs
from megatron_domino.communication.collectives import EMBEDDING_AR, HEAD_DGRAD_AR
from megatron_domino.engine.embedding_overlap import embedding_problems
from megatron_domino.engine.output_head import output_layer_problems

MICRO_BATCH = 4
MODELS = {
    "gpt-tied": GPTOptions(num_layers=2, **TINY, num_attention_heads=4),
    "llama-untied": GPTOptions(
        num_layers=2, **LLAMA_STYLE, add_bias_linear=False, untie_embeddings_and_output_weights=True
    ),
}
SETTINGS = domino_configs("p2", "p4", "p2-k2", "s2")
STOCK_ENDS = domino_configs("p1-k2", "p2-no-backward-overlap")


def _end_spans(model, batch, config) -> dict[str, list]:
    """The embedding's and the output layer's all-reduces of one recorded step, each as
    (chunk, launch order in its direction, direction, overlapped another chunk's compute);
    and per chunk but the last, whether its ``logits`` op ran between the next chunk's last
    MLP all-reduce launch and that chunk's wait for it."""
    recorder = EventRecorder()
    with apply_domino(model, config, recorder=recorder) as handle:
        model(**batch).mean().backward()
        assert not handle.runtime.last_step.pending_backward
    events = recorder.events()
    spans = collective_spans(events)
    found = {
        name: [
            (s.chunk, s.order, s.direction, bool(s.overlapped_by)) for s in spans if s.name == name
        ]
        for name in (EMBEDDING_AR, HEAD_DGRAD_AR)
    }
    last = model.config.num_layers - 1

    def times(kind, name, chunk):
        return [
            e.time_s
            for e in events
            if (e.kind, e.name, e.layer, e.chunk, e.direction) == (kind, name, last, chunk, "fwd")
        ]

    found["logits_under_next_chunk_ar"] = [
        bool(times("begin", "logits", chunk))
        and max(times("launch", "mlp_ar", chunk + 1)) <= min(times("begin", "logits", chunk))
        and max(times("end", "logits", chunk)) <= min(times("wait_begin", "mlp_ar", chunk + 1))
        for chunk in range(config.chunks - 1)
    ]
    return found


def _bound(model, config) -> tuple[bool, bool]:
    """Whether Domino bound (the embedding, the output layer)."""
    with apply_domino(model, config) as handle:
        return "forward" in vars(model.embedding), handle.runtime.head_overlap


def _decoder_alone(model, batch) -> int:
    """Domino's block called on its own (its output never reaches the output layer): the
    backward runs, leaving nothing in flight; the collectives still pending after it."""
    with apply_domino(model, SETTINGS["p2"]) as handle:
        hidden = model.embedding(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        model.decoder(hidden, batch["attention_mask"]).square().mean().backward()
        return len(handle.runtime.last_step.pending_backward)


def _end_checks() -> dict:
    found = {}
    for name, options in MODELS.items():
        model = build_gpt_model(options)
        batch = token_batch(options, MICRO_BATCH)
        comparison = compare_with_stock(model, batch, SETTINGS, tolerance_for(options))
        found[name] = dict(
            failed={
                s: row.mismatches[:3] for s, row in comparison.settings.items() if not row.passed
            },
            spans={s: _end_spans(model, batch, config) for s, config in SETTINGS.items()},
            stock_ends={s: _bound(model, config) for s, config in STOCK_ENDS.items()},
        )
    model = build_gpt_model(MODELS["gpt-tied"])
    found["decoder_alone_pending"] = _decoder_alone(model, token_batch(MODELS["gpt-tied"], 4))
    sequence_parallel = build_gpt_model(
        dataclasses.replace(MODELS["llama-untied"], sequence_parallel=True)
    )
    found["sequence_parallel_bound"] = _bound(sequence_parallel, SETTINGS["p2"])
    return found


def test_both_ends_fly_per_chunk_and_match_stock():
    found = run_on_ranks(_end_checks, 2, timeout_s=300)[0]
    for name in MODELS:
        assert found[name]["failed"] == {}, name
        for setting, spans in found[name]["spans"].items():
            p = SETTINGS[setting].chunks
            # The forward's first p launches, chunk 0 first; the backward's, last chunk first.
            ends = {
                EMBEDDING_AR: ("fwd", list(range(p))),
                HEAD_DGRAD_AR: ("bwd", list(range(p))[::-1]),
            }
            for collective, (direction, chunks) in ends.items():
                recorded = spans[collective]
                assert [(chunk, order, phase) for chunk, order, phase, _ in recorded] == [
                    (chunk, order, direction) for order, chunk in enumerate(chunks)
                ], (name, setting, collective, recorded)
                # Only the first waited has nothing of another chunk to hide behind.
                assert [overlapped for chunk, *_, overlapped in recorded if chunk != chunks[0]] == [
                    True
                ] * (p - 1), (name, setting, collective, recorded)
            assert spans["logits_under_next_chunk_ar"] == [True] * (p - 1), (name, setting)
        assert found[name]["stock_ends"] == {
            "p1-k2": (False, False),
            "p2-no-backward-overlap": (True, False),
        }
    assert found["decoder_alone_pending"] == 0
    assert found["sequence_parallel_bound"] == (False, False)


def test_the_problems_name_what_keeps_each_end_stock():
    config = SimpleNamespace(defer_embedding_wgrad_compute=False, mtp_num_layers=2)
    head = SimpleNamespace(bias=None, gather_output=True, sequence_parallel=False)
    model = SimpleNamespace(post_process=True, output_layer=head, config=config)
    assert output_layer_problems(model, chunks=1) == [
        "one chunk (its all-reduce would have nothing but its own dW to hide behind, as stock)",
        "the output layer is not Megatron-Core's ColumnParallelLinear",
        "the output layer gathers its output",
        "multi-token prediction",
    ]
    first_stage = SimpleNamespace(post_process=False, output_layer=None, config=config)
    assert output_layer_problems(first_stage, chunks=2) == [
        "this pipeline stage has no output layer"
    ]
    config = SimpleNamespace(sequence_parallel=True, recompute_granularity="full")
    embedding = SimpleNamespace(word_embeddings=None, tokentype_embeddings=object())
    model = SimpleNamespace(pre_process=True, embedding=embedding, config=config)
    assert embedding_problems(model, chunks=2) == [
        "the embedding is not Megatron-Core's LanguageModelEmbedding",
        "the word embedding is not Megatron-Core's VocabParallelEmbedding",
        "token-type embeddings",
        "sequence parallelism",
        "full activation recompute (the first layer range is replayed from its input)",
    ]
    later_stage = SimpleNamespace(pre_process=False, embedding=None, config=config)
    assert embedding_problems(later_stage, chunks=2) == ["this pipeline stage has no embedding"]
