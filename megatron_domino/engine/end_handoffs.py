"""What the model's two ends and the transformer block hand each other, held on the runtime.

The embedding hands the block each chunk's embedding with its all-reduce in flight
(:class:`EmbeddingHandoff` of :class:`PendingEmbedding`s, built by
:mod:`megatron_domino.engine.embedding_overlap`); the block hands the output layer each chunk's
final-norm output with its input-gradient all-reduce slot (:class:`HeadHandoff`, taken by
:mod:`megatron_domino.engine.output_head`). :class:`~megatron_domino.engine.state.DominoRuntime` holds them
between the calls, so they live below :mod:`megatron_domino.engine.state`, apart from the modules
that build and take them (which use the runtime).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from megatron.core.models.common.embeddings.language_model_embedding import (
    LanguageModelEmbedding,
)

from megatron_domino.communication.collectives import DgradAllReduce, ForwardAllReduce

__all__ = ["EmbeddingHandoff", "HeadHandoff", "PendingEmbedding"]


@dataclass
class PendingEmbedding:
    """One chunk's embedding: its word-embedding all-reduce in flight, and what is left.

    Attributes:
        slot: the all-reduce of ``partial``.
        partial: this rank's partial sum ``[b/p, s, h]`` (``[b, s/p, h]``), reduced in place.
        embedding: the model's ``LanguageModelEmbedding``.
        positions: the chunk's rows of the position embeddings (``[b/p or 1, s, h]``,
            ``[b or 1, s/p, h]``), looked up once for the micro-batch so that their weight gets
            one gradient as in stock, or ``None`` where the model has none.
    """

    slot: ForwardAllReduce
    partial: torch.Tensor
    embedding: LanguageModelEmbedding
    positions: torch.Tensor | None

    def finish(self) -> torch.Tensor:
        """Wait for the all-reduce; the chunk's embeddings ``[s, b/p, h]`` (``[s/p, b, h]``),
        by Megatron-Core's own ``LanguageModelEmbedding.forward``, its word and position
        embeddings answering with the chunk's rows."""
        self.slot.finish()
        embedding = self.embedding
        with contextlib.ExitStack() as stack:
            stack.enter_context(_answering(embedding.word_embeddings, self.partial))
            if self.positions is not None:
                stack.enter_context(_answering(embedding.position_embeddings, self.positions))
            return LanguageModelEmbedding.forward(embedding, input_ids=None, position_ids=None)


@contextlib.contextmanager
def _answering(module: torch.nn.Module, rows: torch.Tensor):
    """Within the block, calling ``module`` returns ``rows`` (its hooks still run)."""
    module.forward = lambda *args, **kwargs: rows
    try:
        yield
    finally:
        del module.forward


@dataclass(frozen=True)
class EmbeddingHandoff:
    """What the embedding hands the block: the placeholder it returned and the chunks."""

    placeholder: torch.Tensor
    chunks: tuple[PendingEmbedding, ...]


@dataclass(frozen=True)
class HeadHandoff:
    """What the block hands the output layer.

    Attributes:
        joined: the block's output ``[s, b, h]`` (after the final norm), as returned.
        chunks: each chunk's final-norm output (``[s, b/p, h]`` for the batch split, the
            chunk's tokens ``[s/p, b, h]`` for the sequence split), behind its backward wait.
        slots: each chunk's input-gradient all-reduce, in chunk order.
        split_dim: the dimension ``joined`` is the concatenation of ``chunks`` along.
        logits: the logits ``[s, b, V/tp]`` the schedule computed per chunk, or ``None``.
        logits_weight: the output-layer weight ``logits`` were computed with.
    """

    joined: torch.Tensor
    chunks: tuple[torch.Tensor, ...]
    slots: tuple[DgradAllReduce, ...]
    split_dim: int
    logits: torch.Tensor | None = None
    logits_weight: torch.Tensor | None = None
