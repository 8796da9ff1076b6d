"""How a transformer block's input becomes Domino's chunks, and how they are joined again.

Two splits (``DominoConfig.split_along``):

* **batch** (the Domino paper's row split): ``[s, b, h]`` into ``p`` chunks ``[s, b/p, h]``.
  Samples never interact inside a transformer, so the chunks are independent; a per-sample
  mask or attention bias ``[b, ...]`` is sliced with them, shared ones are passed as they are.
* **sequence**: ``[s, b, h]`` into ``p`` token ranges ``[s/p, b, h]``. Everything but
  attention works per token; under a causal mask, chunk ``c`` attends to the keys of chunks
  ``0..c`` only, which the wavefront schedule has computed before it (chunk ``c`` runs ``c``
  ops behind chunk 0; :mod:`megatron_domino.engine.chunk_attention` supplies them). So chunk ``c``
  gets the rows ``[c*s/p, (c+1)*s/p)`` against key columns ``[0, (c+1)*s/p)`` of the mask
  the caller passed, and its own rows of the rotary embedding ``[s, 1, 1, d]``. With no mask
  (Megatron then means causal) none is built here: Transformer Engine's attention never reads
  one for causal types, and Megatron's local attention builds only the chunk's causal rows
  (:func:`megatron_domino.engine.chunk_attention.causal_rows`), never the dense ``[s, s]`` mask
  (``s**2`` bytes per block forward: 1 GiB at ``s = 32k``). This split works at micro-batch
  1, where the batch split has nothing to split.

**Sequence split under sequence parallelism.** Stock SP gives TP rank ``r`` of ``t`` the
contiguous tokens ``[r*s/t, (r+1)*s/t)``. A chunk must be a contiguous token range of the
*whole* sequence (chunk ``c`` may only need keys of chunks before it), so inside the block the
residual stream is laid out **chunk-major** (:func:`to_chunk_major`): rank ``r`` holds, for
each chunk ``c`` in order, the ``r``-th of its ``t`` pieces, tokens
``[c*s/p + r*s/(p*t), c*s/p + (r+1)*s/(p*t))``. A chunk is then ``[s/(p*t), b, h]`` per rank,
and the schedule's all-gather of its norm output yields the chunk's ``s/p`` tokens in order
(and its reduce-scatter returns each rank's piece), exactly as for the batch split. The block
enters and leaves that layout with one all-gather each (backward: a reduce-scatter each),
outside the overlapped schedule: per block forward and backward ``4`` extra collectives of
``[s, b, h]`` against ``8`` per layer that the schedule overlaps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from megatron_domino.base.config import DominoConfig, DominoConfigError
from megatron_domino.engine.state import ChunkState

if TYPE_CHECKING:
    from megatron_domino.engine.end_handoffs import PendingEmbedding

#: The dimension of ``[s, b, h]`` each split cuts.
SPLIT_DIMS = {"batch": 1, "sequence": 0}


def make_chunks(
    hidden_states: torch.Tensor,
    config: DominoConfig,
    attention_inputs: dict,
    *,
    sequence_shards: int = 1,
    embeddings: tuple[PendingEmbedding, ...] | None = None,
) -> list[ChunkState]:
    """The ``p`` chunks of ``hidden_states`` ``[s, b, h]``, each with its attention inputs.

    Args:
        attention_inputs: the block's ``attention_mask`` (``[1 or b, 1, s, s]``, or
            ``None``: causal, passed on as ``None``), ``attention_bias`` and rotary
            embeddings, as the stock block passes them to each layer's self-attention.
        sequence_shards: under the sequence split with sequence parallelism, the TP size
            ``t``: ``hidden_states`` is then this rank's ``[s/t, b, h]`` in the chunk-major
            layout of :func:`to_chunk_major`, while masks and rotary rows cover all ``s``.
        embeddings: the chunks' embeddings in flight
            (:class:`~megatron_domino.engine.end_handoffs.EmbeddingHandoff`); ``hidden_states``
            is then the embedding's placeholder, whose shape alone is read.
    Raises:
        DominoConfigError: the split dimension is not divisible by ``p``
            (:meth:`~megatron_domino.base.config.DominoConfig.shape_problems`).
    """
    p, dim = config.chunks, SPLIT_DIMS[config.split_along]
    size = hidden_states.shape[dim]
    slicer = _batch_slice if config.split_along == "batch" else _sequence_slice
    if config.split_along == "batch":
        config.check_shapes(micro_batch_size=size)
    else:
        size *= sequence_shards  # the whole sequence, which masks and rotary rows cover
        config.check_shapes(seq_length=size, sequence_parallel_size=sequence_shards)
    return [
        ChunkState(
            index=c,
            hidden=hidden.contiguous() if embeddings is None else None,
            attention_inputs={
                name: slicer(name, value, c, p, size) for name, value in attention_inputs.items()
            },
            pending_embedding=None if embeddings is None else embeddings[c],
        )
        for c, hidden in enumerate(hidden_states.chunk(p, dim=dim))
    ]


def join_chunks(chunks: list[ChunkState], config: DominoConfig) -> torch.Tensor:
    """The chunks' residual streams put back together, ``[s, b, h]``."""
    return torch.cat([chunk.hidden for chunk in chunks], dim=SPLIT_DIMS[config.split_along])


def to_chunk_major(
    hidden: torch.Tensor, config: DominoConfig, group: dist.ProcessGroup
) -> torch.Tensor:
    """This rank's sequence shard ``[s/t, b, h]`` re-laid out chunk-major (module docstring).

    One all-gather of the whole sequence (Megatron's
    ``gather_from_sequence_parallel_region``; its backward reduce-scatters, which sums the one
    rank's gradient each token has into its owner's shard), then this rank's pieces.
    """
    t, r, p = group.size(), group.rank(), config.chunks
    config.check_shapes(seq_length=hidden.shape[0] * t, sequence_parallel_size=t)
    pieces = _gather(hidden, group).chunk(p * t, dim=0)  # piece c*t + r' is chunk c, rank r'
    return torch.cat([pieces[c * t + r] for c in range(p)], dim=0)


def from_chunk_major(
    hidden: torch.Tensor, config: DominoConfig, group: dist.ProcessGroup
) -> torch.Tensor:
    """The inverse of :func:`to_chunk_major`: back to this rank's contiguous ``[s/t, b, h]``."""
    t, r, p = group.size(), group.rank(), config.chunks
    pieces = _gather(hidden, group).chunk(p * t, dim=0)  # rank r' holds pieces r'*p + c
    # Token piece g (chunk g // t, rank g % t); this rank's contiguous shard is g in [r*p, r*p+p).
    return torch.cat([pieces[(g % t) * p + g // t] for g in range(r * p, (r + 1) * p)], dim=0)


def _gather(hidden: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``[s/t, b, h]`` -> ``[s, b, h]`` in rank order; backward: reduce-scatter."""
    return gather_from_sequence_parallel_region(
        hidden, tensor_parallel_output_grad=True, group=group
    )


def _batch_slice(name: str, tensor, c: int, p: int, batch: int):
    """Chunk ``c``'s samples of a per-sample tensor ``[b, ...]``; shared ones as they are."""
    per_sample = name in ("attention_mask", "attention_bias")
    if not per_sample or tensor is None or tensor.shape[0] != batch or batch == 1:
        return tensor
    size = batch // p
    return tensor[c * size : (c + 1) * size]


def _sequence_slice(name: str, tensor, c: int, p: int, seq_length: int):
    """Chunk ``c``'s query rows (and the key columns it may see) of a sequence tensor."""
    if tensor is None:
        return None
    size = seq_length // p
    rows = slice(c * size, (c + 1) * size)
    if name == "attention_mask":
        # [*, 1, s, s]: own queries x keys of chunks 0..c; contiguous, as the fused softmax
        # kernel reads it as a dense [*, 1, s/p, (c+1)s/p] array.
        return tensor[..., rows, : (c + 1) * size].contiguous()
    if name == "rotary_pos_emb":  # [s, 1, 1, d]
        return tensor[rows]
    raise DominoConfigError(
        f"--domino-split sequence cannot slice the block argument {name}; use --domino-split "
        "batch for this model."
    )


def causal_attention_mask(seq_length: int, device: torch.device | str) -> torch.Tensor:
    """Megatron's boolean causal mask ``[1, 1, s, s]``: True where attention is masked out.

    Query position i may attend key positions j <= i, so True is strictly above the diagonal.
    It broadcasts over batch and heads. Passing it keeps Megatron from building its default
    mask, which it creates on CUDA.
    """
    ones = torch.ones(seq_length, seq_length, dtype=torch.bool, device=device)
    return torch.triu(ones, diagonal=1).view(1, 1, seq_length, seq_length)
