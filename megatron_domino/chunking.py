"""How a transformer block's input becomes Domino's chunks, and how they are joined again.

Two splits (``DominoConfig.split_along``):

* **batch** (the Domino paper's row split): ``[s, b, h]`` into ``p`` chunks ``[s, b/p, h]``.
  Samples never interact inside a transformer, so the chunks are independent; a per-sample
  mask or attention bias ``[b, ...]`` is sliced with them, shared ones are passed as they are.
* **sequence**: ``[s, b, h]`` into ``p`` token ranges ``[s/p, b, h]``. Everything but
  attention works per token; under a causal mask, chunk ``c`` attends to the keys of chunks
  ``0..c`` only, which the wavefront schedule has computed before it (chunk ``c`` runs ``c``
  ops behind chunk 0; :mod:`megatron_domino.sequence_split` supplies them). So chunk ``c``
  gets mask rows ``[c*s/p, (c+1)*s/p)`` against key columns ``[0, (c+1)*s/p)`` (of the
  causal mask, built here when the caller passes none) and its own rows of the rotary
  embedding ``[s, 1, 1, d]``. This split works at micro-batch 1, where
  the batch split has nothing to split.
"""

from __future__ import annotations

import torch

from megatron_domino.config import DominoConfig, DominoConfigError
from megatron_domino.gpt_model import causal_attention_mask
from megatron_domino.state import ChunkState

#: The dimension of ``[s, b, h]`` each split cuts.
SPLIT_DIMS = {"batch": 1, "sequence": 0}


def make_chunks(
    hidden_states: torch.Tensor, config: DominoConfig, attention_inputs: dict
) -> list[ChunkState]:
    """The ``p`` chunks of ``hidden_states`` ``[s, b, h]``, each with its attention inputs.

    Args:
        attention_inputs: the block's ``attention_mask`` (``[1 or b, 1, s, s]``),
            ``attention_bias`` and rotary embeddings, as the stock block passes them to each
            layer's self-attention.
    Raises:
        DominoConfigError: the split dimension is not divisible by ``p``.
    """
    p, dim = config.chunks, SPLIT_DIMS[config.split_along]
    size = hidden_states.shape[dim]
    if size % p:
        what = "Micro-batch size" if config.split_along == "batch" else "Sequence length"
        raise DominoConfigError(
            f"{what} {size} is not divisible by --domino-chunks {p} (--domino-split "
            f"{config.split_along}); use a chunk count that divides it."
        )
    slicer = _batch_slice if config.split_along == "batch" else _sequence_slice
    if config.split_along == "sequence" and attention_inputs.get("attention_mask") is None:
        # Megatron's default causal mask is square; chunk c's queries need rows of the full one.
        mask = causal_attention_mask(size, hidden_states.device)
        attention_inputs = {**attention_inputs, "attention_mask": mask}
    return [
        ChunkState(
            index=c,
            hidden=hidden.contiguous(),
            attention_inputs={
                name: slicer(name, value, c, p, size) for name, value in attention_inputs.items()
            },
        )
        for c, hidden in enumerate(hidden_states.chunk(p, dim=dim))
    ]


def join_chunks(chunks: list[ChunkState], config: DominoConfig) -> torch.Tensor:
    """The chunks' residual streams put back together, ``[s, b, h]``."""
    return torch.cat([chunk.hidden for chunk in chunks], dim=SPLIT_DIMS[config.split_along])


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
    if name == "attention_mask":  # [*, 1, s, s]: own queries x keys of chunks 0..c
        return tensor[..., rows, : (c + 1) * size]
    if name == "rotary_pos_emb":  # [s, 1, 1, d]
        return tensor[rows]
    raise DominoConfigError(
        f"--domino-split sequence cannot slice the block argument {name}; use --domino-split "
        "batch for this model."
    )
