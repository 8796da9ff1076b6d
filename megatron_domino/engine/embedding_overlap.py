"""The word embedding's all-reduce, launched per chunk and waited by each chunk's first op.

Before the transformer block, ``GPTModel`` runs its embedding on the whole micro-batch:
Megatron-Core's ``VocabParallelEmbedding`` looks up this rank's rows of the vocabulary and
all-reduces the partial sum ``[b, s, h]`` before anything else can run, so the all-reduce,
as large as a layer's, is exposed in stock and under a block-only schedule alike.

Here the embedding's bound forward (:func:`embedding_forward`) runs the lookup with its
all-reduce held back (:func:`_partial_sum_returned`), splits the partial sum into the
chunks (``[b/p, s, h]``, or ``[b, s/p, h]`` for the sequence split), launches each chunk's
all-reduce, and returns a placeholder of the embedding's shape ``[s, b, h]`` (NaN: never
read). The block takes the chunks from the :class:`~megatron_domino.engine.end_handoffs.EmbeddingHandoff` instead of splitting
the placeholder, and each chunk's first op (layer 0's ``attention_norm``) waits for its
all-reduce and then runs the rest of Megatron-Core's ``LanguageModelEmbedding.forward`` on
its rows (position embeddings, ``[b, s, h] -> [s, b, h]``, fp32 residual, dropout), the
word embedding answering with the reduced rows (:meth:`~megatron_domino.engine.end_handoffs.PendingEmbedding.finish`). Chunk
``c``'s all-reduce flies while the chunks before it run their first ops; only chunk 0's
(``1/p`` of the stock one) stays exposed.

It applies where the embedding is Megatron-Core's ``LanguageModelEmbedding`` of a
``VocabParallelEmbedding`` with no token types, without sequence parallelism (the embedding's
collective is then a reduce-scatter), with ``p >= 2``, and where the block's first layer range
is not recomputed (full activation recompute replays it from its input) and autograd is on:
:func:`embedding_problems` names what does not hold; elsewhere the stock embedding runs.
With dropout on, each chunk draws its own embedding-dropout mask, as each chunk does for the
layers' hidden dropout.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
from megatron.core.models.common.embeddings.language_model_embedding import (
    LanguageModelEmbedding,
)
from megatron.core.tensor_parallel import layers as megatron_layers
from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

from megatron_domino.base.recorder import CollectiveLabel
from megatron_domino.communication.collectives import EMBEDDING_AR, ForwardAllReduce
from megatron_domino.engine.end_handoffs import EmbeddingHandoff, PendingEmbedding

if TYPE_CHECKING:
    from megatron_domino.engine.state import DominoRuntime

__all__ = [
    "embedding_forward",
    "embedding_problems",
]

#: The dimension of the embedding's ``[b, s, h]`` each split cuts.
_PARTIAL_SPLIT_DIMS = {"batch": 0, "sequence": 1}


def embedding_problems(model: torch.nn.Module, chunks: int) -> list[str]:
    """Why ``model``'s embedding cannot launch its all-reduce per chunk (module docstring);
    empty when it can. ``model`` is a ``GPTModel`` (one pipeline stage)."""
    embedding = getattr(model, "embedding", None)
    if not getattr(model, "pre_process", False) or embedding is None:
        return ["this pipeline stage has no embedding"]
    checks = {
        "one chunk": chunks < 2,
        "the embedding is not Megatron-Core's LanguageModelEmbedding": type(embedding)
        is not LanguageModelEmbedding,
        "the word embedding is not Megatron-Core's VocabParallelEmbedding": type(
            getattr(embedding, "word_embeddings", None)
        )
        is not VocabParallelEmbedding,
        "token-type embeddings": getattr(embedding, "tokentype_embeddings", None) is not None,
        "sequence parallelism": model.config.sequence_parallel,
        "full activation recompute (the first layer range is replayed from its input)": (
            model.config.recompute_granularity == "full"
        ),
    }
    return [problem for problem, present in checks.items() if present]


@contextlib.contextmanager
def _partial_sum_returned():
    """Within the block, ``VocabParallelEmbedding.forward`` returns its partial sum instead of
    all-reducing it: the one function it calls for that, bound in ``layers`` at import, is an
    identity (restored on exit)."""
    original = megatron_layers.reduce_from_tensor_model_parallel_region
    megatron_layers.reduce_from_tensor_model_parallel_region = lambda input_, group=None: input_
    try:
        yield
    finally:
        megatron_layers.reduce_from_tensor_model_parallel_region = original


def embedding_forward(
    module: LanguageModelEmbedding,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    tokentype_ids=None,
    *,
    runtime: DominoRuntime,
) -> torch.Tensor:
    """The bound ``forward`` of the embedding: with autograd on, the chunks' all-reduces
    launched and a NaN placeholder ``[s, b, h]`` returned (module docstring); otherwise stock.

    Args:
        input_ids: ``[b, s]`` token ids.
        position_ids: ``[b or 1, s]``.
    """
    if not torch.is_grad_enabled() or tokentype_ids is not None:
        return LanguageModelEmbedding.forward(module, input_ids, position_ids, tokentype_ids)
    config = runtime.config
    dim, p = _PARTIAL_SPLIT_DIMS[config.split_along], config.chunks
    with _partial_sum_returned():
        partial = module.word_embeddings(input_ids)  # [b, s, h], this rank's rows only
    b, s, h = partial.shape
    positions = [None] * p
    if module.add_position_embedding:
        rows = module.position_embeddings(position_ids)  # [b or 1, s, h]
        positions = [rows] * p if rows.shape[dim] == 1 else rows.chunk(p, dim=dim)
    chunks = []
    for c, (word_rows, position_rows) in enumerate(
        zip(partial.chunk(p, dim=dim), positions, strict=True)
    ):
        label = CollectiveLabel(EMBEDDING_AR, 0, c, runtime.recorder)
        slot = ForwardAllReduce(runtime.tp_group, label)
        in_flight = slot.launch(word_rows.contiguous())
        chunks.append(PendingEmbedding(slot, in_flight, module, position_rows))
    dtype = torch.float32 if module.config.fp32_residual_connection else partial.dtype
    placeholder = partial.new_full((s, b, h), float("nan"), dtype=dtype)
    runtime.embedding_handoff = EmbeddingHandoff(placeholder, tuple(chunks))
    return placeholder
