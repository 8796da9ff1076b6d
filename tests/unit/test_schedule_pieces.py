"""The schedule's pieces on one process: the wavefront order, the layer groups (segments), the
chunk layout and the plan's dispatch, without a process group or a model.

The rank tests (``ranks/test_domino_overlap.py``, ``ranks/test_domino_equivalence.py``) show
that these pieces together hide communication and compute what stock computes; these show each
piece's own rule, in milliseconds, so that a change to one fails here first and says which.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_domino.base.config import DominoConfig, DominoConfigError
from megatron_domino.base.recorder import NULL_RECORDER
from megatron_domino.engine import chunking, schedule
from megatron_domino.engine.linears import capture_row_input, column_parallel_forward
from megatron_domino.engine.row_output import LOCAL_ROW
from megatron_domino.engine.te_linears import TE_ROW, te_column_parallel_forward
from megatron_domino.plan import LAYER_PLAN, layer_forward

LAYER_OPS = (
    "attention_norm",
    "attention_core",
    "attention_projection",
    "mlp_norm",
    "mlp_core",
    "mlp_projection",
)


def _wavefront_log(op_names: list[str], p: int, kinds=None) -> list[tuple[str, int]]:
    """``(op, chunk)`` in the order :func:`schedule.run_wavefront` runs them (within a tick in
    the order ``kinds``)."""
    log = []
    sequence = [
        (name, 0, functools.partial(lambda name, chunk: log.append((name, chunk.index)), name))
        for name in op_names
    ]
    runtime = SimpleNamespace(recorder=NULL_RECORDER)
    chunks = [SimpleNamespace(index=c) for c in range(p)]
    schedule.run_wavefront(runtime, sequence, chunks, kinds)
    return log


def _forward_covers(log: list[tuple[str, int]], p: int) -> dict:
    """Per row-output all-reduce ``(projection, chunk)`` of the first layer: the other chunks'
    ops run between its launch (the projection) and its wait (the next norm)."""
    covers = {}
    for c in range(p):
        for launch, wait in (
            ("attention_projection", "mlp_norm"),
            ("mlp_projection", "attention_norm"),
        ):
            launched = log.index((launch, c))
            waited = next(i for i, step in enumerate(log) if i > launched and step == (wait, c))
            covers[launch, c] = [step for step in log[launched:waited] if step[1] != c]
    return covers


def test_the_wavefront_runs_chunk_c_c_ops_behind_chunk_0():
    assert _wavefront_log(["a", "b", "c"], 2) == [
        ("a", 0),
        ("b", 0),
        ("a", 1),
        ("c", 0),
        ("b", 1),
        ("c", 1),
    ]
    for p in (2, 3, 4):
        log = _wavefront_log([*LAYER_OPS, "finish"], p)
        assert len(log) == 7 * p  # every op once per chunk
        for c in range(p):  # each chunk in op order
            assert [name for name, chunk in log if chunk == c] == [*LAYER_OPS, "finish"]


@pytest.mark.parametrize("p", [2, 4])
def test_each_projections_collective_flies_behind_the_next_chunks_core(p):
    """Chunk c's projection (launch) and its next norm (wait) have chunk c+1's core between
    them: the Domino paper's order (arXiv 2409.15241, sec. 4)."""
    log = _wavefront_log(list(LAYER_OPS) * 2, p)
    for c in range(p - 1):
        for launch, core, wait in (
            ("attention_projection", "attention_core", "mlp_norm"),
            ("mlp_projection", "mlp_core", "attention_norm"),
        ):
            launched = log.index((launch, c))
            waited = next(i for i, step in enumerate(log) if i > launched and step == (wait, c))
            assert (core, c + 1) in log[launched:waited], (launch, c, log[launched:waited])


@pytest.mark.parametrize("p", [2, 4])
def test_launch_first_ticks_launch_before_they_wait(p):
    """With legs the forward runs each tick's projections (launches) first, then the cores,
    then the norms (waits): every row output's all-reduce flies behind at least two ops of
    other chunks, one of them a core, where chunk order gives chunk 0's only one at p = 2."""
    ops = list(LAYER_OPS) * 2
    launch_first = _forward_covers(_wavefront_log(ops, p, schedule.LAUNCH_FIRST), p)
    chunk_order = _forward_covers(_wavefront_log(ops, p), p)
    for (launch, c), cover in launch_first.items():
        assert len(cover) >= 2 and any(name.endswith("_core") for name, _ in cover), (launch, c)
        assert len(cover) >= len(chunk_order[launch, c]), (launch, c)
    if p == 2:
        assert len(chunk_order["attention_projection", 0]) == 1
        assert launch_first["attention_projection", 0] == [
            ("attention_core", 1),
            ("attention_projection", 1),
        ]


def test_the_tick_order_is_launch_first_only_with_legs_and_without_sequence_parallelism():
    def runtime(legs, sequence_parallel):
        return SimpleNamespace(step=SimpleNamespace(legs=legs), sequence_parallel=sequence_parallel)

    assert schedule.tick_order(runtime(object(), False)) == schedule.LAUNCH_FIRST
    assert schedule.tick_order(runtime(None, False)) is None
    assert schedule.tick_order(runtime(object(), True)) is None
    assert set(schedule.OP_KINDS.values()) == set(schedule.LAUNCH_FIRST)


class _FakeLayerOps:
    """Stands in for :class:`schedule.LayerOps`: records the segment links it was given."""

    def __init__(self, runtime, layer, index, previous, sublayers):
        self.index, self.previous, self.sublayers = index, previous, sublayers
        self.following = None

    def ops(self):
        return [
            (f"{sublayer}_{op}", None)
            for sublayer in self.sublayers
            for op in ("norm", "core", "projection")
        ]

    def finish(self, chunk):
        pass


def _segments(
    monkeypatch,
    inter_layer: bool,
    layers: int,
    final_layernorm=None,
    chunk_logits=None,
    sublayers=None,
):
    """The op sequences :func:`schedule.run_layers` hands the wavefront, one per segment, for
    ``layers`` layers from block position 5 (each a GPT layer, or with ``sublayers`` the
    sub-layers of each)."""
    sublayers = sublayers or [schedule.SUBLAYERS] * layers
    sequences = []
    monkeypatch.setattr(schedule, "LayerOps", _FakeLayerOps)
    monkeypatch.setattr(
        schedule, "run_wavefront", lambda rt, seq, chunks, kinds: sequences.append(seq)
    )
    runtime = SimpleNamespace(
        config=DominoConfig(chunks=2, inter_layer=inter_layer),
        chunk_logits=chunk_logits,
        step=SimpleNamespace(legs=None),
        sequence_parallel=False,
        layer_sublayers=(None,) * 5 + tuple(sublayers),
    )
    schedule.run_layers(
        runtime, [object()] * layers, [], first_index=5, final_layernorm=final_layernorm
    )
    return sequences


def test_inter_layer_overlap_makes_the_stack_one_segment(monkeypatch):
    (sequence,) = _segments(monkeypatch, inter_layer=True, layers=3)
    assert [(name, layer) for name, layer, _ in sequence] == [
        *((name, layer) for layer in (5, 6, 7) for name in LAYER_OPS),
        ("finish", 7),
    ]


def test_a_hybrid_stack_runs_three_ops_per_sub_layer_of_each_layer(monkeypatch):
    """A HybridModel's ``*-*`` layers: the attention's three ops, the MLP's, the attention's,
    then the last layer's finish (which ends its attention)."""
    kinds = [("attention",), ("mlp",), ("attention",)]
    (sequence,) = _segments(monkeypatch, inter_layer=True, layers=3, sublayers=kinds)
    assert [(name, layer) for name, layer, _ in sequence] == [
        *(
            (f"{s}_{op}", layer)
            for layer, (s,) in zip((5, 6, 7), kinds, strict=True)
            for op in ("norm", "core", "projection")
        ),
        ("finish", 7),
    ]


def test_without_it_every_layer_is_a_segment_that_finishes(monkeypatch):
    sequences = _segments(monkeypatch, inter_layer=False, layers=3)
    assert len(sequences) == 3
    for layer, sequence in zip((5, 6, 7), sequences, strict=True):
        assert [name for name, _, _ in sequence] == [*LAYER_OPS, "finish"]
        assert {op_layer for _, op_layer, _ in sequence} == {layer}


def test_only_the_last_segments_finish_places_the_output_layers_wait(monkeypatch):
    norm = object()
    sequences = _segments(monkeypatch, inter_layer=False, layers=2, final_layernorm=norm)
    assert sequences[0][-1][2].__name__ == "finish"
    assert sequences[1][-1][2].__name__ == "finish_then_head_wait"


def test_the_logits_op_follows_the_last_finish_where_the_runtime_computes_them(monkeypatch):
    computed = []

    def chunk_logits(runtime, chunk):
        computed.append(chunk)

    sequences = _segments(
        monkeypatch,
        inter_layer=False,
        layers=2,
        final_layernorm=object(),
        chunk_logits=chunk_logits,
    )
    assert [name for name, _, _ in sequences[0]][-1] == "finish"
    assert [(name, layer) for name, layer, _ in sequences[1][-2:]] == [("finish", 6), ("logits", 6)]
    sequences[1][-1][2]("chunk 0")
    assert computed == ["chunk 0"]


def test_the_batch_split_cuts_samples_and_their_masks():
    hidden = torch.arange(3 * 4 * 2.0).view(3, 4, 2)  # [s, b, h]
    mask = torch.zeros(4, 1, 3, 3, dtype=torch.bool)
    mask[2:] = True  # samples 2 and 3
    chunks = chunking.make_chunks(
        hidden, DominoConfig(chunks=2), {"attention_mask": mask, "rotary_pos_emb": None}
    )
    assert [c.index for c in chunks] == [0, 1]
    assert torch.equal(chunks[1].hidden, hidden[:, 2:])
    assert not chunks[0].attention_inputs["attention_mask"].any()
    assert chunks[1].attention_inputs["attention_mask"].all()
    assert torch.equal(chunking.join_chunks(chunks, DominoConfig(chunks=2)), hidden)
    with pytest.raises(DominoConfigError):
        chunking.make_chunks(hidden, DominoConfig(chunks=3), {})


def test_the_sequence_split_gives_each_chunk_its_queries_against_the_keys_before_it():
    s, p = 8, 4
    config = DominoConfig(chunks=p, split_along="sequence")
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)
    rotary = torch.arange(float(s)).view(s, 1, 1, 1)
    chunks = chunking.make_chunks(
        torch.zeros(s, 1, 2), config, {"attention_mask": mask, "rotary_pos_emb": rotary}
    )
    for c, chunk in enumerate(chunks):
        rows = slice(2 * c, 2 * c + 2)
        assert chunk.hidden.shape == (2, 1, 2)
        assert torch.equal(chunk.attention_inputs["attention_mask"], mask[..., rows, : 2 * c + 2])
        assert torch.equal(chunk.attention_inputs["rotary_pos_emb"], rotary[rows])
    with pytest.raises(DominoConfigError, match="cannot slice the block argument attention_bias"):
        chunking.make_chunks(torch.zeros(s, 1, 2), config, {"attention_bias": mask})


@pytest.mark.parametrize(("t", "p"), [(2, 2), (2, 4), (4, 2)])
def test_chunk_major_layout_gives_each_rank_a_piece_of_every_chunk(monkeypatch, t, p):
    """Tokens ``0..s-1``; rank r's stock SP shard is the contiguous ``[r*s/t, (r+1)*s/t)``."""
    s = 2 * p * t
    tokens = torch.arange(float(s)).view(s, 1, 1)
    config = DominoConfig(chunks=p, split_along="sequence")
    shards = list(tokens.chunk(t))
    monkeypatch.setattr(chunking, "_gather", lambda hidden, group: torch.cat(shards))
    chunk_major = []
    for r in range(t):
        group = SimpleNamespace(size=lambda: t, rank=lambda r=r: r)
        laid_out = chunking.to_chunk_major(shards[r], config, group).flatten().tolist()
        piece = s // (p * t)
        assert laid_out == [
            c * s / p + r * piece + i for c in range(p) for i in range(piece)
        ]  # chunk c's r-th piece, chunks in order
        chunk_major.append(chunking.to_chunk_major(shards[r], config, group))
    shards = chunk_major  # the gather now returns the chunk-major shards, in rank order
    for r in range(t):
        group = SimpleNamespace(size=lambda: t, rank=lambda r=r: r)
        back = chunking.from_chunk_major(chunk_major[r], config, group)
        assert torch.equal(back, tokens.chunk(t)[r])


def _te_linear() -> torch.nn.Module:
    """A module TE's interface checks recognise as a TE linear (``parallel_mode``,
    ``te_return_bias``, as Megatron's wrappers have)."""
    module = torch.nn.Linear(2, 2)
    module.parallel_mode, module.te_return_bias = "row", True
    return module


def test_the_plan_binds_each_target_by_kind_and_implementation():
    targets = {target.name: target for target in LAYER_PLAN}
    local, te = torch.nn.Linear(2, 2), _te_linear()
    overlap, no_overlap = DominoConfig(chunks=2), DominoConfig(chunks=2, backward_overlap=False)
    for row in ("linear_proj", "linear_fc2"):
        for module, gemm in ((local, LOCAL_ROW), (te, TE_ROW)):
            bound = layer_forward(targets[row], module, overlap)
            assert bound.func is capture_row_input and bound.keywords == {"gemm": gemm}
    for column in ("linear_qkv", "linear_fc1"):
        assert layer_forward(targets[column], local, overlap) is column_parallel_forward
        assert layer_forward(targets[column], local, no_overlap) is None  # stock serves
        assert layer_forward(targets[column], te, no_overlap) is te_column_parallel_forward
    core = targets["core_attention"]
    assert core.stock is DotProductAttention
    assert layer_forward(core, torch.nn.Identity(), overlap) is None  # the batch split
    sequence = DominoConfig(chunks=2, split_along="sequence")
    assert layer_forward(core, torch.nn.Identity(), sequence).keywords["attend"].__name__ == (
        "local_attend"
    )
