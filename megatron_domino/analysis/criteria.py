"""What a recorded Domino step must look like: how many collectives, and what they overlapped.

Pure functions of the :class:`~megatron_domino.analysis.spans.CollectiveSpan` s of one recorded
forward and backward, shared by the overlap tests' criteria and
the GPU check (from a checkout, ``make gpu-check``). They are orderings, not timings, so they hold on any
machine load and with CPU wall-clock or CUDA-event times alike.

Counts, per layer (collective names end in ``_ar``, ``_ag``, ``_rs`` or ``_regather``):

* without sequence parallelism: ``2 p k`` forward all-reduces (attention projection and fc2,
  ``p`` chunks, ``k`` column pieces) and, with backward overlap, ``2 p`` input-gradient
  all-reduces (QKV and fc1); and once per step, where the embedding launches its all-reduce
  per chunk (``embedding``, :mod:`megatron_domino.engine.embedding_overlap`), ``p`` more forward,
  and where the output layer takes its input gradient per chunk (``output_layer``,
  :mod:`megatron_domino.engine.output_head`), ``p`` more backward;
* with it: ``2 p`` all-gathers (QKV and fc1 inputs) and ``2 p k`` reduce-scatters (projection
  and fc2 outputs) in forward; in backward each keeps its forward twin's name (the gather's
  twin reduce-scatters dX, the scatter's twin gathers dY), so the same counts again, plus
  ``2 p`` re-gathers of the column linears' inputs, which autograd kept as this rank's shard.

Overlap:

* ``p >= 2`` without sequence parallelism: every collective but the last to finish waiting,
  per direction, had another chunk's (or piece's) compute between its launch and its wait;
  so did the embedding's all-reduces but chunk 0's (waited by the forward's first op) and
  the output layer's but the last chunk's (its wait is the backward's first: only the output
  layer's own weight gradient runs before it);
* ``p >= 2`` with sequence parallelism: every collective but the first and the last launched,
  per direction (the first forward all-gather has no other chunk started yet; its backward
  twin is the backward's last), and but the first re-gather launched (the last layer's fc1
  input of the last chunk: no other chunk's backward runs before that chunk's fc1 backward,
  so it overlaps that chunk's own fc2 backward only);
* ``p = 1, k >= 2`` (no sequence parallelism): each forward piece 0 flew during piece 1's GEMM.
"""

from __future__ import annotations

from collections import Counter

from megatron_domino.analysis.spans import CollectiveSpan
from megatron_domino.base.config import DominoConfig
from megatron_domino.communication.collectives import EMBEDDING_AR, HEAD_DGRAD_AR

__all__ = [
    "collective_counts",
    "count_mismatches",
    "expected_collective_counts",
    "first_wait_of_an_end",
    "overlap_criterion",
    "overlap_violations",
]

DIRECTIONS = ("fwd", "bwd")


def collective_counts(spans: list[CollectiveSpan]) -> Counter:
    """Collectives by ``(direction, kind)``, kind being the name's suffix (``ar``/``ag``/``rs``)."""
    return Counter((s.direction, s.name.rsplit("_", 1)[-1]) for s in spans)


def expected_collective_counts(
    config: DominoConfig,
    *,
    num_layers: int,
    sequence_parallel: bool,
    embedding: bool = False,
    output_layer: bool = False,
) -> Counter:
    """The counts :func:`collective_counts` must give for one forward and backward;
    ``embedding`` / ``output_layer``: the step ran the model's embedding / output layer, and
    Domino bound them (a one-stage model without sequence parallelism, ``p >= 2``)."""
    p, k, n = config.chunks, config.column_chunks, num_layers
    if sequence_parallel:
        return Counter(
            {
                ("fwd", "ag"): n * 2 * p,
                ("fwd", "rs"): n * 2 * p * k,
                ("bwd", "ag"): n * 2 * p,
                ("bwd", "rs"): n * 2 * p * k,
                ("bwd", "regather"): n * 2 * p,
            }
        )
    ends = p >= 2 and not sequence_parallel
    expected = Counter({("fwd", "ar"): n * 2 * p * k + (p if embedding and ends else 0)})
    if config.backward_overlap:
        expected[("bwd", "ar")] = n * 2 * p + (p if output_layer and ends else 0)
    return expected


def count_mismatches(
    spans: list[CollectiveSpan],
    config: DominoConfig,
    *,
    num_layers: int,
    sequence_parallel: bool,
    embedding: bool = False,
    output_layer: bool = False,
) -> list[str]:
    """``"fwd ar: 10 recorded, 12 expected"`` for each (direction, kind) that is off."""
    got = collective_counts(spans)
    want = expected_collective_counts(
        config,
        num_layers=num_layers,
        sequence_parallel=sequence_parallel,
        embedding=embedding,
        output_layer=output_layer,
    )
    return [
        f"{direction} {kind}: {got[(direction, kind)]} recorded, {want[(direction, kind)]} expected"
        for direction, kind in sorted(set(got) | set(want))
        if got[(direction, kind)] != want[(direction, kind)]
    ]


def first_wait_of_an_end(span: CollectiveSpan, chunks: int) -> bool:
    """Chunk 0's embedding all-reduce (the forward's first wait) or the last chunk's
    output-layer all-reduce (the backward's first), of ``chunks`` chunks: nothing of another
    chunk can run before their waits."""
    if span.name == EMBEDDING_AR:
        return span.chunk == 0
    return span.name == HEAD_DGRAD_AR and span.chunk == chunks - 1


def overlap_criterion(config: DominoConfig, *, sequence_parallel: bool) -> str | None:
    """The overlap rule that applies to ``config`` (one line), or ``None`` if none is defined."""
    if config.chunks >= 2 and sequence_parallel:
        return (
            "every collective but the first and last launched per direction (and the "
            "backward's first re-gather) overlapped"
        )
    if config.chunks >= 2:
        return "every collective but the last per direction overlapped another chunk's compute"
    if config.column_chunks >= 2 and not sequence_parallel:
        return "every forward piece 0 flew during piece 1's GEMM"
    return None


def overlap_violations(
    spans: list[CollectiveSpan], config: DominoConfig, *, sequence_parallel: bool
) -> list[CollectiveSpan]:
    """The spans that break :func:`overlap_criterion`'s rule (empty when it holds).

    Raises:
        ValueError: no rule is defined for ``config`` (sequence parallelism with ``p = 1``).
    """
    if overlap_criterion(config, sequence_parallel=sequence_parallel) is None:
        raise ValueError(
            f"no overlap criterion for chunks={config.chunks}, "
            f"column_chunks={config.column_chunks}, sequence_parallel={sequence_parallel}."
        )
    if config.chunks == 1:
        first_pieces = [s for s in spans if s.direction == "fwd" and s.piece == 0]
        return [s for s in first_pieces if not any(r[3] == 1 for r in s.overlapped_by)]
    violations = []
    for direction in DIRECTIONS:
        chosen = [s for s in spans if s.direction == direction]
        if sequence_parallel:
            candidates = sorted(chosen, key=lambda s: s.order)[1:-1]
            regathers = [s for s in candidates if s.name.endswith("_regather")]
            candidates = [s for s in candidates if s not in regathers[:1]]
        else:
            candidates = sorted(chosen, key=lambda s: s.wait_end_s)[:-1]
            candidates = [s for s in candidates if not first_wait_of_an_end(s, config.chunks)]
        violations += [s for s in candidates if not s.overlapped_by]
    return violations
