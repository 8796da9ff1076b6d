"""Who owns Domino's in-flight work: a runtime per patched model, a step per forward call.

Communication handles never live in module globals. :class:`DominoRuntime` belongs to the
handle returned by ``apply_domino`` and is shared by the patched modules of one model;
each forward of the transformer block (of each layer range, under full activation recompute,
and again for its replay) creates a :class:`StepState` holding one :class:`ChunkState` per
chunk, and drops it when the forward returns, after checking
that no forward collective is still in flight. Backward collectives are owned by the slots
the step created (:mod:`megatron_domino.communication.collectives`); ``last_step`` keeps them so callers
(tests, the overlap report) can check that a backward left nothing pending.

Chunk shapes are written for the batch split, ``[s, b/p, h]``; under the sequence split
read ``[s/p, b, h]``.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_domino.base.config import DominoConfig
from megatron_domino.base.recorder import NULL_RECORDER, NullRecorder
from megatron_domino.engine.legs import LegBook

if TYPE_CHECKING:
    from collections.abc import Callable

    from megatron_domino.communication.collectives import DgradAllReduce, SequenceCollective
    from megatron_domino.communication.saved_shards import SavedInputRegather
    from megatron_domino.engine.end_handoffs import EmbeddingHandoff, HeadHandoff, PendingEmbedding
    from megatron_domino.engine.row_output import DeferredRow, PendingReduce


@dataclass
class ChunkState:
    """One row chunk's progress through the layer stack during one forward call.

    Attributes:
        index: chunk number ``c`` in ``0..p-1``; the chunk holds samples ``[c*b/p, (c+1)*b/p)``
            (or, with the sequence split, tokens ``[c*s/p, (c+1)*s/p)``).
        hidden: residual stream ``[s, b/p, h]`` (``[s/p, b, h]``) after the last finished
            sub-layer.
        attention_inputs: keyword arguments of this chunk's self-attention calls: its slice
            of the mask and attention bias, and the rotary embeddings (sliced to its tokens
            under the sequence split).
        residual: residual input of the sub-layer in progress ``[s, b/p, h]``.
        linear_input: norm output ``[s, b/p, h]`` feeding the next column-parallel linear.
        dgrad_slot: backward all-reduce slot for that column-parallel linear.
        gather_slot: under sequence parallelism, the all-gather of ``linear_input``
            (``[s/tp, b/p, h]`` to ``[s, b/p, h]``), launched in the norm op and waited in the
            core op.
        input_regather: under sequence parallelism (with autograd on), what the column linear
            of the sub-layer in progress keeps of its gathered input (this rank's shard), and
            its backward re-gather, launched by the backward of the next wait of this chunk's
            row-linear reduce-scatter.
        deferred: the row-parallel linear's call, captured while the core ran (its input
            ``[s, b/p, n/tp]``), so that the GEMM can run in the next op.
        pending: the row-parallel output whose all-reduce is in flight.
        pending_bias: that linear's bias, returned separately (``skip_bias_add``).
        pending_embedding: before the chunk's first op, its embedding whose all-reduce is in
            flight (:mod:`megatron_domino.engine.embedding_overlap`); ``hidden`` is ``None`` until
            that op finishes it.
    """

    index: int
    hidden: torch.Tensor | None
    attention_inputs: dict
    residual: torch.Tensor | None = None
    linear_input: torch.Tensor | None = None
    dgrad_slot: DgradAllReduce | None = None
    gather_slot: SequenceCollective | None = None
    input_regather: SavedInputRegather | None = None
    deferred: DeferredRow | None = None
    pending: PendingReduce | None = None
    pending_bias: torch.Tensor | None = None
    pending_embedding: PendingEmbedding | None = None


@dataclass
class StepState:
    """Everything one Domino forward call owns.

    ``active`` is the chunk whose op is running, in sub-layer ``sublayer`` (``attention`` or
    ``mlp``) of layer ``layer``; the patched linears act for it. During a core op the
    row-parallel linear ``deferred_module`` only records its call, which the projection op
    then runs (:func:`~megatron_domino.engine.linears.row_projection`). Under the
    sequence split, ``key_values[layer]`` holds each earlier chunk's keys and values
    ``[s/p, b, g/tp, d]`` (after rotary embedding), which later chunks attend to, each with the
    token its leg shared it under (``None`` without legs). ``legs`` cuts each chunk's work into
    the legs whose backward Domino orders (:mod:`megatron_domino.engine.legs`), or is ``None``
    where the backward is autograd's (:meth:`DominoRuntime.leg_book`).
    """

    chunks: list[ChunkState]
    dgrad_slots: list[DgradAllReduce] = field(default_factory=list)
    #: The output layer's per-chunk input-gradient all-reduces (:mod:`megatron_domino.engine.output_head`).
    head_slots: list[DgradAllReduce] = field(default_factory=list)
    #: The micro-batch's logits ``[s, b, V/tp]``, filled chunk by chunk inside the schedule, and
    #: the output-layer weight they were computed with (:func:`~megatron_domino.engine.output_head.chunk_logits`).
    head_logits: torch.Tensor | None = None
    head_weight: torch.Tensor | None = None
    sequence_slots: list[SequenceCollective] = field(default_factory=list)
    #: Held weakly: they keep activation shards, which must go with the autograd graph.
    regathers: weakref.WeakSet[SavedInputRegather] = field(default_factory=weakref.WeakSet)
    key_values: dict[int, list[tuple[torch.Tensor, torch.Tensor, tuple | None]]] = field(
        default_factory=dict
    )
    legs: LegBook | None = None
    active: ChunkState | None = None
    layer: int = -1
    sublayer: str = ""
    deferred_module: torch.nn.Module | None = None

    @property
    def pending_forward(self) -> list:
        """Forward collectives still in flight (row outputs and sequence-parallel gathers)."""
        rows = [c.pending for c in self.chunks if c.pending is not None and c.pending.in_flight]
        embeddings = [c.pending_embedding for c in self.chunks if c.pending_embedding is not None]
        return rows + embeddings + [slot for slot in self.sequence_slots if slot.pending]

    @property
    def pending_backward(self) -> list:
        """Backward collectives launched but not yet waited."""
        slots = [*self.dgrad_slots, *self.head_slots, *self.sequence_slots, *self.regathers]
        return [slot for slot in slots if slot.pending]


class DominoRuntime:
    """State shared by one model's patched modules: settings, group, recorder, current step.

    ``sequence_parallel`` mirrors the model's setting: the residual stream is then
    ``[s/tp, b, h]`` and the row/column collectives are reduce-scatters and all-gathers.
    ``head_overlap`` says the model's output layer is bound to take its input gradient per
    chunk in flight; ``chunk_logits`` then computes a chunk's logits inside the schedule
    (:func:`~megatron_domino.engine.output_head.chunk_logits` on the model), and ``head_handoff`` is what the last block forward left it
    (:mod:`megatron_domino.engine.output_head`); ``embedding_handoff`` is what the embedding left the
    next block forward (:mod:`megatron_domino.engine.embedding_overlap`).
    """

    def __init__(
        self,
        config: DominoConfig,
        tp_group: dist.ProcessGroup,
        recorder: NullRecorder = NULL_RECORDER,
        sequence_parallel: bool = False,
    ) -> None:
        self.config = config
        self.tp_group = tp_group
        self.recorder = recorder
        self.sequence_parallel = sequence_parallel
        self.step: StepState | None = None
        self.last_step: StepState | None = None
        #: Where current-scaling FP8 casts reduce their amax (tensorwise + SP on TE layers;
        #: :mod:`megatron_domino.runtime.amax_group`), else ``None``.
        self.amax_group: dist.ProcessGroup | None = None
        #: Per layer of the block, its sub-layers in order (``("attention", "mlp")``, or one of
        #: them in a HybridModel: :data:`megatron_domino.plan.LAYER_SUBLAYERS`); set by
        #: :func:`~megatron_domino.apply.apply_domino`.
        self.layer_sublayers: tuple[tuple[str, ...], ...] = ()
        self.head_overlap = False
        self.chunk_logits: Callable[[DominoRuntime, ChunkState], None] | None = None
        self.head_handoff: HeadHandoff | None = None
        self.embedding_handoff: EmbeddingHandoff | None = None

    @contextlib.contextmanager
    def new_step(self, chunks: list[ChunkState]):
        """Run one forward call's schedule; on exit, check it drained and release its tensors."""
        if self.step is not None:
            raise RuntimeError(
                "A Domino step is already running on this model (re-entrant forward)."
            )
        self.step = StepState(chunks=chunks)
        self.step.legs = self.leg_book(self.step)
        try:
            yield self.step
            if self.step.pending_forward:
                raise RuntimeError(
                    f"Domino bug: {len(self.step.pending_forward)} forward collectives still in "
                    "flight at the end of the transformer block."
                )
        finally:
            self.last_step, self.step = self.step, None
            # The chunks and cached keys hold activations: keep only the backward slots.
            self.last_step.chunks = []
            self.last_step.key_values = {}
            self.last_step.legs = None

    def leg_book(self, step: StepState) -> LegBook | None:
        """The legs of ``step``, where Domino orders the backward: autograd on, backward overlap
        on (always under sequence parallelism) and ``backward_order`` not ``autograd``.

        Under sequence parallelism each sub-layer's work is cut three times (the backward
        collectives launched and waited in different ops: the schedule's module docstring), and
        :func:`~megatron_domino.engine.legs.backward_order` lags each chunk one leg behind the
        next; without it, once per sub-layer, no lag.
        """
        config = self.config
        if not (
            torch.is_grad_enabled()
            and config.backward_overlap
            and config.backward_order != "autograd"
        ):
            return None
        return LegBook(
            len(step.chunks),
            lag=1 if self.sequence_parallel else 0,
            serial=config.backward_order == "serial",
            in_flight=lambda: step.pending_backward,
        )

    @contextlib.contextmanager
    def acting_for(
        self, chunk: ChunkState, layer: int, sublayer: str, *, defer: torch.nn.Module | None = None
    ):
        """Make ``chunk`` the one the patched linears act for during one op."""
        step = self.step
        step.active, step.layer, step.sublayer, step.deferred_module = chunk, layer, sublayer, defer
        try:
            yield
        finally:
            step.active, step.deferred_module = None, None
