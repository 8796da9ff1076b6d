"""Domino's ``TransformerBlock.forward`` (and ``HybridStack.forward``): split into chunks, run
the schedule, join, final norm.

It replaces the stock forward of one block instance (see :mod:`megatron_domino.apply`)
and keeps its contract (a ``HybridStack``'s is the same: ``HybridModel`` calls it with the
same keyword arguments, and it groups full recompute into the same ranges): hidden states ``[s, b, h]`` in, ``[s, b, h]`` out after the final
norm, called with keyword arguments by ``GPTModel``. What the stock forward does around the
layer loop (viewless tensors, the final norm, the FP8 context, full activation recompute by
ranges of layers, see :func:`layer_groups`) is done the same way; the features it handles
that Domino does not (offloading, cross-attention, inference) were refused when Domino was
applied, and arguments that only they use must be ``None`` here.

FP8 (delayed scaling, the only recipe Domino accepts): like the stock forward, one
``fp8_autocast`` wraps the whole layer stack, now for all chunks. TE accumulates each
quantized tensor's amax as a running maximum over every call inside it, and reduces the
amaxes and updates the scales once, when it exits: once per micro-batch, as stock, and from
the same amax the unchunked batch would give (the maximum over the chunks).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from megatron.core.fp8_utils import get_fp8_context
from megatron.core.tensor_parallel import checkpoint, get_cuda_rng_tracker
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.utils import WrappedTensor, make_viewless_tensor

from megatron_domino.base.config import DominoUnsupportedError
from megatron_domino.engine.chunking import (
    SPLIT_DIMS,
    from_chunk_major,
    join_chunks,
    make_chunks,
    to_chunk_major,
)
from megatron_domino.engine.end_handoffs import HeadHandoff, PendingEmbedding
from megatron_domino.engine.schedule import run_layers
from megatron_domino.engine.state import DominoRuntime

#: Keyword arguments of the stock forward passed on to every layer's self-attention (sliced
#: per chunk by :mod:`megatron_domino.engine.chunking` where they are per sample or per token).
ATTENTION_ARGS = ("attention_bias", "rotary_pos_emb", "rotary_pos_cos", "rotary_pos_sin")
#: Keyword arguments Domino accepts but that do not matter for dense GPT training.
IGNORED_ARGS = ("padding_mask", "dynamic_inference_decode_only")


def domino_block_forward(
    block: TransformerBlock, hidden_states, attention_mask=None, *, runtime: DominoRuntime, **kwargs
) -> torch.Tensor:
    """Forward of a Domino-patched block.

    Args:
        hidden_states: ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism, or a
            ``WrappedTensor``), the embedding output; on a later pipeline stage ignored for
            ``block.input_tensor``, the previous stage's output.
        attention_mask: ``[1, 1, s, s]`` shared, or ``[b, 1, s, s]`` per sample (sliced per chunk).
        **kwargs: the stock forward's other keyword arguments; unsupported ones must be None.
    Returns:
        ``[s, b, h]`` after the final norm.
    """
    _refuse_unsupported_arguments(kwargs)
    if isinstance(hidden_states, WrappedTensor):
        hidden_states = hidden_states.unwrap()
    if not block.pre_process:
        # A later pipeline stage: the schedule hands in the previous stage's output.
        hidden_states = block.input_tensor
    embeddings = _embedding_handoff(runtime, hidden_states)
    if embeddings is None:
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)

    attention_inputs = {"attention_mask": attention_mask}
    attention_inputs |= {name: kwargs[name] for name in ATTENTION_ARGS if name in kwargs}
    run_group = functools.partial(_run_group, block, runtime, attention_inputs=attention_inputs)
    # Under sequence parallelism each rank holds other tokens, so hidden dropout draws from
    # the tensor-parallel RNG stream, as in the stock forward.
    rng = get_cuda_rng_tracker().fork() if runtime.sequence_parallel else contextlib.nullcontext()
    fp8 = get_fp8_context(block.config) if block.config.fp8 else contextlib.nullcontext()
    # The sequence split under SP runs on the chunk-major layout (megatron_domino.engine.chunking).
    chunk_major = runtime.sequence_parallel and runtime.config.split_along == "sequence"
    if chunk_major:
        hidden_states = to_chunk_major(hidden_states, runtime.config, runtime.tp_group)
    groups = layer_groups(block)
    # Where the output layer takes its gradients per chunk, the last group runs the final norm
    # per chunk and hands the chunks over (megatron_domino.engine.output_head).
    final_norm = final_norm_of(block)
    head = (
        runtime.head_overlap
        and torch.is_grad_enabled()
        and final_norm is not None
        and not chunk_major
        and not groups[-1][2]
    )
    with rng, fp8:
        for first, last, recomputed in groups:
            final = final_norm if head and last == len(block.layers) else None
            group = functools.partial(
                run_group,
                first=first,
                last=last,
                final_layernorm=final,
                embeddings=embeddings if first == 0 else None,
            )
            if recomputed:
                hidden_states = checkpoint(
                    group, block.config.distribute_saved_activations, hidden_states
                )
            else:
                hidden_states = group(hidden_states)
    if chunk_major:
        hidden_states = from_chunk_major(hidden_states, runtime.config, runtime.tp_group)

    if final_norm is not None and not head:
        hidden_states = final_norm(hidden_states)
        hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
    return hidden_states


def final_norm_of(block: torch.nn.Module) -> torch.nn.Module | None:
    """The stack's final norm, or ``None`` where this pipeline stage has none: a
    ``TransformerBlock``'s ``final_layernorm`` (``None`` there), a ``HybridStack``'s
    ``final_norm`` (absent there)."""
    if isinstance(block, TransformerBlock):
        return block.final_layernorm
    return getattr(block, "final_norm", None)


def layer_groups(block: TransformerBlock) -> list[tuple[int, int, bool]]:
    """``(first, last, recomputed)`` layer ranges the block runs one after another.

    Without full activation recompute (or outside training, as in the stock forward): all
    layers at once. With it, the ranges Megatron-Core checkpoints: ``uniform`` groups of
    ``recompute_num_layers`` layers, or with ``block`` the first ``recompute_num_layers``
    layers one by one and the rest at once. Each range is one Domino step: its collectives
    are all waited inside it, so that its recompute in backward replays a self-contained
    schedule (inter-layer overlap stops at range boundaries).
    """
    config, n = block.config, len(block.layers)
    if config.recompute_granularity != "full" or not block.training:
        return [(0, n, False)]
    k = config.recompute_num_layers
    if config.recompute_method == "uniform":
        return [(i, min(i + k, n), True) for i in range(0, n, k)]
    groups = [(i, i + 1, True) for i in range(min(k, n))]
    return groups + ([(k, n, False)] if k < n else [])


def _run_group(
    block: TransformerBlock,
    runtime: DominoRuntime,
    hidden_states: torch.Tensor,
    *,
    first: int,
    last: int,
    attention_inputs: dict,
    final_layernorm: torch.nn.Module | None = None,
    embeddings: tuple[PendingEmbedding, ...] | None = None,
) -> torch.Tensor:
    """Layers ``first..last-1`` on ``hidden_states`` ``[s, b, h]``, as one Domino step.

    Splits the input into the chunks, runs the schedule, and joins them again; called again
    with the same input when a recomputed range is replayed in backward. With
    ``final_layernorm`` the chunks end with it and are handed to the output layer
    (:class:`~megatron_domino.engine.end_handoffs.HeadHandoff`); with ``embeddings`` they start as the
    embedding's chunks in flight (:mod:`megatron_domino.engine.embedding_overlap`).
    """
    shards = runtime.tp_group.size() if runtime.sequence_parallel else 1
    chunks = make_chunks(
        hidden_states,
        runtime.config,
        attention_inputs,
        sequence_shards=shards,
        embeddings=embeddings,
    )
    with runtime.new_step(chunks) as step:
        run_layers(
            runtime,
            block.layers[first:last],
            chunks,
            first_index=first,
            final_layernorm=final_layernorm,
        )
        joined = join_chunks(chunks, runtime.config)
        if final_layernorm is not None:
            runtime.head_handoff = HeadHandoff(
                joined,
                tuple(chunk.hidden for chunk in chunks),
                tuple(step.head_slots),
                SPLIT_DIMS[runtime.config.split_along],
                step.head_logits,
                step.head_weight,
            )
        return joined


def _embedding_handoff(
    runtime: DominoRuntime, hidden_states: torch.Tensor
) -> tuple[PendingEmbedding, ...] | None:
    """The chunks' embeddings in flight, where the embedding launched them for this input.

    Raises:
        RuntimeError: the embedding launched its chunks' all-reduces but the block got another
            input (a model flow Domino does not know): the placeholder would be read.
    """
    handoff, runtime.embedding_handoff = runtime.embedding_handoff, None
    if handoff is None:
        return None
    if handoff.placeholder is not hidden_states:
        raise RuntimeError(
            "Domino: the embedding launched its per-chunk all-reduces, but the transformer "
            "block received another input than the embedding's output, which is a placeholder "
            "until the chunks' first ops; this model's forward is unsupported with Domino."
        )
    return handoff.chunks


def _refuse_unsupported_arguments(kwargs: dict) -> None:
    supported = set(ATTENTION_ARGS) | set(IGNORED_ARGS)
    used = sorted(
        name for name, value in kwargs.items() if value is not None and name not in supported
    )
    if used:
        raise DominoUnsupportedError(
            f"Domino does not support these TransformerBlock arguments: {', '.join(used)} "
            "(cross-attention, packed sequences, inference and rotary cos/sin caches run only "
            "on the stock path). Train without --domino for this model."
        )
