"""The chunked schedule: a transformer block's forward as a wavefront over chunks.

The block input ``[s, b, h]`` is split into ``p`` chunks (:mod:`megatron_domino.engine.chunking`):
along ``b`` into ``[s, b/p, h]`` (samples never interact inside a transformer, so each chunk
runs the layer stack on its own), or along ``s`` into ``[s/p, b, h]`` (whose attention also
reads the earlier chunks' keys, :mod:`megatron_domino.engine.chunk_attention`). Shapes below are
written for the batch split. Each layer of a ``GPTModel`` is, per chunk, six ops that call
Megatron-Core's own submodules, three per sub-layer (a ``HybridModel``'s ``*`` layer has the
attention's three, its ``-`` layer the MLP's: :data:`megatron_domino.plan.LAYER_SUBLAYERS`;
a layer's first norm op then also finishes the layer before, whichever sub-layer it ended with):

=====================  =============================================================  =====
op                     work (all on this chunk)                                       kind
=====================  =============================================================  =====
attention_norm         [wait mlp all-reduce of layer l-1; mlp bias-dropout-add], or   P
                       [wait the embedding's all-reduce, finish the embedding];
                       input_layernorm; place the backward wait of the QKV dX
attention_core         self_attention up to linear_proj: QKV, RoPE, core attention    H
attention_projection   linear_proj GEMM (k pieces); launch its all-reduce(s)          R
mlp_norm               wait; self-attention bias-dropout-add; pre_mlp_layernorm;     P
                       place the backward wait of the fc1 dX
mlp_core               mlp up to linear_fc2: fc1, activation                          H
mlp_projection         linear_fc2 GEMM (k pieces); launch its all-reduce(s)           R
=====================  =============================================================  =====

and a final ``finish`` (wait, the last sub-layer's bias-dropout-add) after the last layer of a
segment; where
the output layer takes its input gradient per chunk, the block's last finish also runs the
final norm per chunk (:func:`with_head_wait`), and one more op, ``logits``, the chunk's
output-layer GEMM (:func:`~megatron_domino.engine.output_head.chunk_logits`): one tick after chunk
``c``'s finish, so it runs after chunk ``c+1``'s last projection has launched its all-reduce
and before chunk ``c+1``'s finish waits for it.

**Wavefront.** At tick ``t`` chunk ``c`` runs its op ``t - c``. So chunk ``c+1``'s core runs
between chunk ``c``'s projection (launch) and its next norm (wait): every forward all-reduce
flies behind another chunk's GEMMs. For ``p = 2`` in chunk order this is exactly the order of
the Domino paper (arXiv 2409.15241, sec. 4). Within a tick the ops are independent; where the
step has legs (below) and no sequence parallelism, a tick runs its projections (launches)
first, then its cores, then its norms (waits): *launch-first* (:func:`tick_order`,
:data:`OP_KINDS`), so that each all-reduce flies behind two ops of another chunk. Forward at
``p = 2``, layer ``l`` (``↑`` launch, ``↓`` wait of the row output's all-reduce, ``AR``)::

    tick  launch-first                                   chunk order (autograd's backward)
    t     c1 mlp_projection(l-1) ↑, c0 attention_norm ↓  c0 attention_norm ↓, c1 mlp_projection ↑
    t+1   c0 attention_core,        c1 attention_norm ↓  the same
    t+2   c0 attention_projection ↑, c1 attention_core   the same
    t+3   c1 attention_projection ↑, c0 mlp_norm ↓       c0 mlp_norm ↓, c1 attention_projection ↑
    t+4   c0 mlp_core,              c1 mlp_norm ↓        the same
    t+5   c0 mlp_projection ↑,      c1 mlp_core          the same

Chunk 0's attention AR flies behind chunk 1's core and projection (its core only in chunk
order), chunk 1's behind chunk 0's norm and core.

**Backward: legs** (:mod:`megatron_domino.engine.legs`, ``--domino-backward-order legs``,
the default wherever a backward collective is in flight: with backward overlap, always under
sequence parallelism). Left to autograd, the backward would replay the forward's creation order
reversed, so the op between a chunk's norm (the dX wait) and its core (the dX launch) would be
the other chunk's projection of the same tick, and launch-first would take it away. Instead the
schedule cuts each chunk's ops into *legs* at the points where a backward collective is launched
in one op and waited in another (:meth:`LayerOps._cut`); each leg's backward runs whole, in the
order :func:`~megatron_domino.engine.legs.backward_order` gives. Without sequence parallelism
the cut is the column input (the norm output behind its dX wait), so a layer has two legs per
chunk: ``A(c, l)`` = attention_core .. mlp_norm and ``M(c, l)`` = mlp_core .. attention_norm of
``l+1``. ``Q``/``F``: the QKV/fc1 input-gradient all-reduce (``attention_dgrad_ar``,
``mlp_dgrad_ar``), launched at the end of the leg that holds the column linear and waited first
by the leg before it. Backward at ``p = 2``, legs of one position, chunks from the last::

    step  leg        waits first   launches last   flies meanwhile
    1     M(c1, l)   Q(l+1, c1)    F(l, c1)        Q(l+1, c0)
    2     M(c0, l)   Q(l+1, c0)    F(l, c0)        F(l, c1)
    3     A(c1, l)   F(l, c1)      Q(l, c1)        F(l, c0)
    4     A(c0, l)   F(l, c0)      Q(l, c0)        Q(l, c1)

Each all-reduce flies behind the other chunk's whole leg (its projection, core and column
linear backward); with ``p`` chunks behind ``p - 1`` legs. Under sequence parallelism a
sub-layer's backward has three collectives: the all-gather of the row linear's output
gradient (``*_rs``'s twin, launched by the next norm op's backward, waited by the projection
op's), the re-gather of the column linear's saved input (``*_regather``, launched with it,
waited by the column linear's backward) and the reduce-scatter of the column input's gradient
(``*_ag``'s twin, launched by the core op's backward, waited by the norm op's). So every op is
a leg: ``K`` (core), ``R`` (projection), ``N`` (norm: the reduce-scatter's wait, bias-dropout-add,
norm, the all-gather's launch), and each chunk runs one leg behind the next chunk (lag 1), so
that each collective flies behind a larger leg of the other chunk::

    step  leg               waits first          launches last
    1     K(c1, mlp)        (fc1 input regather) fc1 dX reduce-scatter c1
    2     R(c0, mlp)        fc2 dY gather c0     -
    3     N(c1, mlp_norm)   fc1 dX c1            proj dY gather c1, QKV input regather c1
    4     K(c0, mlp)        (fc1 input regather) fc1 dX reduce-scatter c0
    5     R(c1, attention)  proj dY gather c1    -
    6     N(c0, mlp_norm)   fc1 dX c0            proj dY gather c0, QKV input regather c0

(dY gathers fly behind a core, dX reduce-scatters behind a projection, re-gathers behind two
legs). ``--domino-backward-order autograd`` keeps autograd's order and chunk-order ticks (the
ablation); ``serial`` runs each chunk's legs back to back (a negative control). The table of
collectives says per collective which leg launches and which waits
(:data:`~megatron_domino.communication.collectives.COLLECTIVE_SITES`).

**Segments.** With inter-layer overlap the whole stack is one segment: the last chunk's MLP
all-reduce of layer ``l`` is waited in layer ``l+1``'s ``attention_norm``. Without it, each
layer is a segment that ends with every chunk's ``finish``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import make_viewless_tensor

from megatron_domino.base.recorder import CollectiveLabel
from megatron_domino.communication.collectives import (
    SUBLAYER_LABELS,
    DgradAllReduce,
    SequenceCollective,
)
from megatron_domino.communication.saved_shards import SavedInputRegather
from megatron_domino.communication.sequence_parallel import (
    InputGradientScatter,
    launch_gather,
    wait_gather,
)
from megatron_domino.communication.te_fp8_inputs import quantized_norm_output
from megatron_domino.communication.te_quantizers import fp8_input_quantizer
from megatron_domino.engine.backward_overlap import wait_for_dgrad_reduce
from megatron_domino.engine.linears import row_projection
from megatron_domino.engine.output_head import place_head_wait
from megatron_domino.engine.state import ChunkState, DominoRuntime

Op = Callable[[ChunkState], None]
#: A ``GPTModel`` layer's sub-layers, in order.
SUBLAYERS = ("attention", "mlp")


class LayerOps:
    """The ops of one layer for any chunk (see the module docstring): three per sub-layer.

    Args:
        runtime: the model's Domino runtime (step state, settings, recorder).
        layer: the Megatron-Core layer whose submodules the ops call.
        index: the layer's 0-based position in the block (for labels).
        previous: the layer before in the same segment, whose last all-reduce this layer's
            first norm op finishes (inter-layer overlap); ``None`` for a segment's first.
        sublayers: the layer's sub-layers in order (:data:`megatron_domino.plan.LAYER_SUBLAYERS`:
            ``("attention", "mlp")`` for a ``TransformerLayer`` of a ``GPTModel``, one of them
            for a ``HybridModel``'s ``*`` or ``-`` layer, whose other sub-layer is Megatron's
            identity).
    """

    def __init__(
        self,
        runtime: DominoRuntime,
        layer: TransformerLayer,
        index: int,
        previous: LayerOps | None,
        sublayers: tuple[str, ...] = SUBLAYERS,
    ) -> None:
        self.runtime = runtime
        self.layer = layer
        self.index = index
        self.previous = previous
        self.sublayers = sublayers
        #: The layer after in the same segment (set by :func:`run_layers`), for labels.
        self.following: LayerOps | None = None

    def ops(self) -> list[tuple[str, Op]]:
        """``(name, op)`` in the order a chunk runs them: per sub-layer its norm, core and
        projection."""
        return [
            op
            for sublayer in self.sublayers
            for op in (
                (f"{sublayer}_norm", getattr(self, f"{sublayer}_norm")),
                (f"{sublayer}_core", getattr(self, f"{sublayer}_core")),
                (f"{sublayer}_projection", functools.partial(self.projection, sublayer)),
            )
        ]

    def attention_norm(self, chunk: ChunkState) -> None:
        self._norm_op("attention", self.layer.input_layernorm, chunk)

    def attention_core(self, chunk: ChunkState) -> None:
        attention = self.layer.self_attention
        self._finish_gather(chunk)
        with self.runtime.acting_for(chunk, self.index, "attention", defer=attention.linear_proj):
            attention(chunk.linear_input, **chunk.attention_inputs)
        chunk.dgrad_slot = None

    def projection(self, sublayer: str, chunk: ChunkState) -> None:
        """Run the row-parallel GEMM the core op captured; launch its collectives.

        Under sequence parallelism with legs, a leg ends before the GEMM (its input, the
        captured ``[s, b/p, n/tp]``) and after the launches (the reduce-scatters' outputs in
        flight): the module docstring's cuts.
        """
        sequence_cuts = self.runtime.sequence_parallel and self.runtime.step.legs is not None
        if sequence_cuts:
            deferred = chunk.deferred
            chunk.deferred = deferred.with_input(
                self._cut(chunk, f"{sublayer}_projection", deferred.input_)
            )
        chunk.pending, chunk.pending_bias = row_projection(
            self.runtime, chunk, self.index, sublayer
        )
        if sequence_cuts:
            waiting_op = self._waiting_op(sublayer)
            chunk.pending.hand_on(lambda *outputs: self._cut(chunk, waiting_op, *outputs))

    def mlp_norm(self, chunk: ChunkState) -> None:
        self._norm_op("mlp", self.layer.pre_mlp_layernorm, chunk)

    def mlp_core(self, chunk: ChunkState) -> None:
        self._finish_gather(chunk)
        with self.runtime.acting_for(chunk, self.index, "mlp", defer=self.layer.mlp.linear_fc2):
            self.layer.mlp(chunk.linear_input)
        chunk.dgrad_slot = None

    def finish(self, chunk: ChunkState) -> None:
        """Wait for this layer's last all-reduce and add it to the residual stream."""
        hidden = self._bias_dropout_add(self._bda(self.sublayers[-1]), chunk)
        chunk.hidden = make_viewless_tensor(
            inp=hidden, requires_grad=hidden.requires_grad, keep_graph=True
        )
        chunk.residual = None

    def _norm_op(self, sublayer: str, norm: torch.nn.Module, chunk: ChunkState) -> None:
        """The norm op of ``sublayer``: its input is the layer's (:meth:`_layer_input`) for the
        layer's first sub-layer, else the sub-layer before's output added to the residual
        (after waiting for its all-reduce); ``norm`` of it, readied for the column linear."""
        position = self.sublayers.index(sublayer)
        if position == 0:
            hidden = self._layer_input(chunk)
        else:
            hidden = self._bias_dropout_add(self._bda(self.sublayers[position - 1]), chunk)
        chunk.linear_input = self._column_input(norm, hidden, chunk, sublayer)

    def _layer_input(self, chunk: ChunkState) -> torch.Tensor:
        """The layer's input ``[s, b/p, h]``: the layer before finished (inter-layer overlap), or
        the chunk's embedding once its all-reduce is waited."""
        if self.previous is not None:
            self.previous.finish(chunk)
        if chunk.pending_embedding is not None:
            chunk.hidden, chunk.pending_embedding = chunk.pending_embedding.finish(), None
        return chunk.hidden

    def _bda(self, sublayer: str):
        """The bias-dropout-add module that ends ``sublayer``."""
        return self.layer.self_attn_bda if sublayer == "attention" else self.layer.mlp_bda

    def _waiting_op(self, sublayer: str) -> str:
        """The name of the op that waits for ``sublayer``'s row output: the next sub-layer's
        norm, in this layer or the next of the segment, or ``finish``."""
        position = self.sublayers.index(sublayer)
        if position + 1 < len(self.sublayers):
            return f"{self.sublayers[position + 1]}_norm"
        if self.following is not None:
            return f"{self.following.sublayers[0]}_norm"
        return "finish"

    def _column_input(
        self, norm: torch.nn.Module, hidden: torch.Tensor, chunk: ChunkState, sublayer: str
    ) -> torch.Tensor:
        """``norm`` of ``hidden`` ``[s, b/p, h]`` (the chunk's residual from now on), readied for
        the sub-layer's column-parallel linear (:meth:`_prepare_column_input`).

        Under sequence parallelism with the linear Transformer Engine's in an FP8 autocast, the
        norm runs once, as TE's norm op, and its fp32 result is cast to FP8 inside it with the
        linear's input quantizer, as stock TE's fused layer casts it: the FP8 output carries the
        gradient (:func:`~megatron_domino.communication.te_fp8_inputs.quantized_norm_output`).
        """
        runtime = self.runtime
        column = self._column_linear(sublayer)
        quantizer = fp8_input_quantizer(column) if runtime.sequence_parallel else None
        if quantizer is None:
            normed, chunk.residual = self._norm(norm, hidden)
        else:
            normed = quantized_norm_output(norm, hidden, quantizer, runtime.amax_group)
            chunk.residual = (
                hidden.float() if self.layer.config.fp32_residual_connection else hidden
            )
        return self._prepare_column_input(normed, chunk, sublayer, quantizer)

    def _norm(self, norm, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm output, residual)`` for ``hidden`` ``[s, b/p, h]``, as the stock layer forms them.

        The residual is ``hidden``, unless the norm returns ``(output, residual)`` itself
        (Megatron-Core 0.19's fused-residual norms); with ``fp32_residual_connection`` it is
        kept in fp32.
        """
        normed, residual = norm(hidden), hidden
        if isinstance(normed, tuple):
            normed, residual = normed
        if self.layer.config.fp32_residual_connection:
            residual = residual.float()
        return normed, residual

    def _bias_dropout_add(self, bda_module, chunk: ChunkState) -> torch.Tensor:
        """Wait for the sub-layer's all-reduce, then Megatron's bias-dropout-add ``[s, b/p, h]``.

        Under sequence parallelism the wait's backward also launches the re-gather of the
        sub-layer's column-linear input, whose backward comes after another chunk's core op.
        """
        regather, chunk.input_regather = chunk.input_regather, None
        output = chunk.pending.wait(regather.launch if regather is not None else None)
        bias, chunk.pending, chunk.pending_bias = chunk.pending_bias, None, None
        layer = self.layer
        with layer.bias_dropout_add_exec_handler():
            return bda_module(layer.training, layer.config.bias_dropout_fusion)(
                (output, bias), chunk.residual, layer.hidden_dropout
            )

    def _prepare_column_input(
        self, normed: torch.Tensor, chunk: ChunkState, sublayer: str, quantizer=None
    ) -> torch.Tensor:
        """Ready the norm output ``[s or s/tp, b/p, h]`` for the next column-parallel linear.

        Under sequence parallelism: launch its all-gather (waited in the core op; in FP8 when
        ``normed`` is the FP8 cast by the linear's input ``quantizer``, as stock TE gathers it,
        :mod:`megatron_domino.communication.te_fp8_inputs`), and with autograd on, prepare the
        linear to keep only this rank's shard (``normed``, FP8 or not) for backward.
        Otherwise, with backward overlap: place the backward wait of the linear's dX all-reduce.
        """
        runtime, labels = self.runtime, SUBLAYER_LABELS[sublayer]
        grad = torch.is_grad_enabled() and normed.requires_grad
        if runtime.sequence_parallel:
            label = CollectiveLabel(labels.input_ag, self.index, chunk.index, runtime.recorder)
            chunk.gather_slot = SequenceCollective(runtime.tp_group, label)
            runtime.step.sequence_slots.append(chunk.gather_slot)
            quantized = None if quantizer is None else normed
            if grad:
                label = CollectiveLabel(
                    labels.input_regather, self.index, chunk.index, runtime.recorder
                )
                chunk.input_regather = SavedInputRegather(
                    runtime.tp_group, label, normed, quantized, quantizer
                )
                runtime.step.regathers.add(chunk.input_regather)
            launched = launch_gather(normed, chunk.gather_slot, quantized, quantizer)
            return self._cut(chunk, f"{sublayer}_core", launched)
        if not (runtime.config.backward_overlap and grad):
            return normed
        label = CollectiveLabel(labels.input_dgrad_ar, self.index, chunk.index, runtime.recorder)
        chunk.dgrad_slot = DgradAllReduce(runtime.tp_group, label)
        runtime.step.dgrad_slots.append(chunk.dgrad_slot)
        return self._cut(chunk, f"{sublayer}_core", wait_for_dgrad_reduce(normed, chunk.dgrad_slot))

    def _cut(self, chunk: ChunkState, op: str, *tensors: torch.Tensor):
        """Where the step has legs (:mod:`megatron_domino.engine.legs`), end ``chunk``'s leg with
        ``tensors`` and its residual and begin the next, which starts with ``op``: ``tensors``
        as the next leg's (one tensor, or a tuple of several), ``chunk.residual`` likewise."""
        legs = self.runtime.step.legs
        if legs is not None:
            *tensors, chunk.residual = legs.cut(
                chunk.index, op, self.index, *tensors, chunk.residual
            )
        return tensors[0] if len(tensors) == 1 else tuple(tensors)

    def _column_linear(self, sublayer: str) -> torch.nn.Module:
        """The column-parallel linear the norm output of ``sublayer`` feeds."""
        if sublayer == "attention":
            return self.layer.self_attention.linear_qkv
        return self.layer.mlp.linear_fc1

    @staticmethod
    def _finish_gather(chunk: ChunkState) -> None:
        """Under sequence parallelism, wait for the column linear's gathered input ``[s, b/p, h]``;
        the slot becomes the column linear's, whose backward (Megatron's local linear) reduce-
        scatters the input gradient through it (:class:`InputGradientScatter`)."""
        if chunk.gather_slot is not None:
            chunk.linear_input = wait_gather(chunk.linear_input, chunk.gather_slot)
            chunk.dgrad_slot, chunk.gather_slot = InputGradientScatter(chunk.gather_slot), None


def segment_ops(layer_ops: list[LayerOps]) -> list[tuple[str, int, Op]]:
    """The op sequence of one segment: three ops per sub-layer of each layer, then the last
    layer's finish."""
    sequence = [(name, ops.index, op) for ops in layer_ops for name, op in ops.ops()]
    sequence.append(("finish", layer_ops[-1].index, layer_ops[-1].finish))
    return sequence


def with_head_wait(
    finish: tuple[str, int, Op], runtime: DominoRuntime, final_layernorm
) -> tuple[str, int, Op]:
    """The segment's ``finish`` op, followed by the final norm with the backward wait of the
    output layer's all-reduce (:func:`~megatron_domino.engine.output_head.place_head_wait`).

    In one op, so that chunk ``c``'s wait is created before the later chunks' last projection:
    in backward that projection's GEMMs run between chunk ``c+1``'s wait and chunk ``c``'s,
    while chunk ``c``'s all-reduce flies.
    """
    name, layer, op = finish

    def finish_then_head_wait(chunk: ChunkState) -> None:
        op(chunk)
        place_head_wait(runtime, final_layernorm, layer, chunk)

    return name, layer, finish_then_head_wait


#: What each op does to the collectives in flight: launches them (``launch``), computes while
#: they fly (``compute``) or waits for one (``wait``). The norm ops' kind is their wait: without
#: sequence parallelism they launch nothing in forward.
OP_KINDS = {
    "attention_norm": "wait",
    "attention_core": "compute",
    "attention_projection": "launch",
    "mlp_norm": "wait",
    "mlp_core": "compute",
    "mlp_projection": "launch",
    "finish": "wait",
    "logits": "compute",
}
#: Launch-first: within a tick, ops in this order of their kinds (module docstring).
LAUNCH_FIRST = ("launch", "compute", "wait")


def tick_order(runtime: DominoRuntime) -> tuple[str, ...] | None:
    """The kinds of op a tick runs first to last, or ``None`` for chunk order (0 to ``p-1``).

    Launch-first where the step has legs without sequence parallelism: the backward order no
    longer follows the forward's, so the forward may launch each all-reduce before another
    chunk waits. Under sequence parallelism a norm op also launches (its input all-gather,
    waited by the next core op), which chunk order already puts behind another chunk's op.
    """
    if runtime.step.legs is None or runtime.sequence_parallel:
        return None
    return LAUNCH_FIRST


def run_wavefront(
    runtime: DominoRuntime,
    sequence: list[tuple[str, int, Op]],
    chunks: list[ChunkState],
    kinds: tuple[str, ...] | None = None,
) -> None:
    """Run ``sequence`` on every chunk, chunk ``c`` lagging ``c`` ops behind chunk 0; within a
    tick, ops by their kind in the order ``kinds`` (:func:`tick_order`), else in chunk order."""
    recorder = runtime.recorder
    for tick in range(len(sequence) + len(chunks) - 1):
        due = [
            (chunk, sequence[tick - chunk.index])
            for chunk in chunks
            if 0 <= tick - chunk.index < len(sequence)
        ]
        if kinds is not None:
            due.sort(key=lambda item: kinds.index(OP_KINDS[item[1][0]]))
        for chunk, (name, layer, op) in due:
            with recorder.region(name, layer, chunk.index):
                op(chunk)


def run_layers(
    runtime: DominoRuntime,
    layers,
    chunks: list[ChunkState],
    *,
    first_index: int = 0,
    final_layernorm: torch.nn.Module | None = None,
) -> None:
    """Run all ``layers`` on ``chunks`` (in place), one segment or one per layer.

    ``first_index`` is the block position of ``layers[0]`` (for labels). With
    ``final_layernorm``, the last segment's finish ends :func:`with_head_wait`, followed by
    the ``logits`` op where the runtime has one.
    """
    inter_layer, kinds = runtime.config.inter_layer, tick_order(runtime)
    segments: list[list[LayerOps]] = []
    for index, layer in enumerate(layers, start=first_index):
        previous = segments[-1][-1] if inter_layer and segments else None
        ops = LayerOps(runtime, layer, index, previous, runtime.layer_sublayers[index])
        if previous is None:
            segments.append([ops])
        else:
            previous.following = ops
            segments[-1].append(ops)
    for number, segment in enumerate(segments, start=1):
        sequence = segment_ops(segment)
        if final_layernorm is not None and number == len(segments):
            sequence[-1] = with_head_wait(sequence[-1], runtime, final_layernorm)
            if runtime.chunk_logits is not None:
                logits = functools.partial(runtime.chunk_logits, runtime)
                sequence.append(("logits", segment[-1].index, logits))
        run_wavefront(runtime, sequence, chunks, kinds)
    legs = runtime.step.legs
    if legs is not None:
        for chunk, last in zip(chunks, legs.finish([c.hidden for c in chunks]), strict=True):
            chunk.hidden = last
