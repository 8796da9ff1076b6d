"""Every collective Domino runs, from the launch that starts it to the wait that ends it.

Megatron-Core launches a tensor-parallel collective and waits for it in the same call. Domino
launches it at one point of the schedule and waits at a later one, after another chunk's work
was issued; between the two, the collective is *in flight*. :class:`InFlight` is that state,
for every kind: it starts the collective(s) asynchronously, records the launch and the wait
with the event recorder (:mod:`megatron_domino.base.recorder`), refuses a second launch before the
wait, and drops the handles once waited. The kinds:

* :class:`ForwardAllReduce`: one column piece of a row-parallel linear's partial sum
  ``[s, b/p, h/k]``, all-reduced in place in forward (backward: identity, Megatron's "g"
  operator; the row linear's output gradient is already replicated on every TP rank);
* :class:`DgradAllReduce`: a column-parallel linear's input gradient ``[s, b/p, h]``,
  launched by its backward and waited by the identity on its input
  (:mod:`megatron_domino.engine.backward_overlap`);
* :class:`SequenceCollective`: under sequence parallelism, an all-gather or reduce-scatter
  along ``s``, reused by the forward collective and its backward twin
  (:mod:`megatron_domino.communication.sequence_parallel`); under FP8 on TE layers the forward all-gather
  moves the FP8 bits of the shard, as stock TE's does (:mod:`megatron_domino.communication.te_fp8_inputs`).

The sequence-parallel re-gather of a column linear's saved input
(:class:`~megatron_domino.communication.saved_shards.SavedInputRegather`) is an :class:`InFlight` too: the
all-gathers of every tensor it kept, launched and waited as one collective.

**Where is a collective launched, and where is it waited?** Look its recorder label up in
:data:`COLLECTIVE_SITES`, the one table of every collective Domino issues (18 rows): per
label and direction, its kind, and the call path of its launch and of its wait as
``module:function``, outermost first (a forward path starts at the schedule's op in
:class:`~megatron_domino.engine.schedule.LayerOps`, a backward one at the autograd node the engine
calls). E.g. chunk ``c``'s ``attention_ar`` is launched by the ``attention_projection`` op
(``engine.schedule:LayerOps.projection -> engine.linears:row_projection -> engine.row_output:PendingReduce.launch``)
and waited by the ``mlp_norm`` op (``engine.schedule:LayerOps._bias_dropout_add ->
engine.row_output:PendingReduce.wait``). The labels are the constants below (:data:`SUBLAYER_LABELS`,
:data:`EMBEDDING_AR`, :data:`HEAD_DGRAD_AR`, :data:`FP8_AMAX_AR`), the only place their strings
are written; a traced step records exactly the table's labels and call paths, and every
collective a traced TE FP8 step issues from Domino's code is one of the table's rows, the
blocking amax reductions of Domino's chunked FP8 casts included
(``tests/ranks/test_collective_sites.py``). Not in the table: Megatron-Core's own collectives
where Domino leaves them to stock (the vocab-parallel cross entropy, the embedding and output
layer under sequence parallelism, TE's column-linear backward without it) and the GPU check's
synthetic ``inflight_check``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_domino.base.recorder import LAUNCH, WAIT_BEGIN, WAIT_END, CollectiveLabel
from megatron_domino.communication.te_fp8_inputs import GatherUse, quantized_gather

__all__ = [
    "COLLECTIVE_SITES",
    "EMBEDDING_AR",
    "FP8_AMAX_AR",
    "HEAD_DGRAD_AR",
    "SUBLAYER_LABELS",
    "CollectiveSite",
    "DgradAllReduce",
    "ForwardAllReduce",
    "InFlight",
    "SequenceCollective",
    "SublayerLabels",
    "collective_site",
]

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER = "all_reduce", "all_gather", "reduce_scatter"


@dataclass(frozen=True)
class SublayerLabels:
    """The recorder labels of one sub-layer's collectives (attention's or the MLP's).

    Attributes:
        output_ar: the row linear's output all-reduce (forward).
        output_rs: under sequence parallelism, its reduce-scatter (forward) and that one's
            backward twin, the all-gather of the output gradient.
        input_dgrad_ar: the column linear's input-gradient all-reduce (backward).
        input_ag: under sequence parallelism, the all-gather of the column linear's input
            (forward) and its backward twin, the reduce-scatter of the input gradient.
        input_regather: under sequence parallelism, the backward re-gather of the column
            linear's saved input shard.
    """

    output_ar: str
    output_rs: str
    input_dgrad_ar: str
    input_ag: str
    input_regather: str

    def row_output(self, sequence_parallel: bool) -> str:
        """The label of the row linear's output collective."""
        return self.output_rs if sequence_parallel else self.output_ar


#: Per sub-layer, the labels of its collectives: the sub-layer's name and the collective's
#: (``attention_ar``, ``mlp_dgrad_ar``, ...).
SUBLAYER_LABELS = {
    sublayer: SublayerLabels(
        output_ar=f"{sublayer}_ar",
        output_rs=f"{sublayer}_rs",
        input_dgrad_ar=f"{sublayer}_dgrad_ar",
        input_ag=f"{sublayer}_ag",
        input_regather=f"{sublayer}_regather",
    )
    for sublayer in ("attention", "mlp")
}
#: The word embedding's all-reduce, per chunk (:mod:`megatron_domino.engine.embedding_overlap`).
EMBEDDING_AR = "embedding_ar"
#: The output layer's input-gradient all-reduce, per chunk (:mod:`megatron_domino.engine.output_head`).
HEAD_DGRAD_AR = "head_dgrad_ar"
#: Under FP8 current scaling with SP, the amax reduction of a chunk's gathered cast, blocking,
#: on the amax group (:mod:`megatron_domino.runtime.amax_group`).
FP8_AMAX_AR = "fp8_amax_ar"


@dataclass(frozen=True)
class CollectiveSite:
    """One collective Domino issues: a row of :data:`COLLECTIVE_SITES`.

    Attributes:
        label: the recorder's name (:class:`~megatron_domino.base.recorder.CollectiveLabel`).
        kind: ``all_reduce``, ``all_gather`` or ``reduce_scatter``.
        direction: ``fwd`` or ``bwd`` (the recorder's direction of its launch and wait).
        launched_in: the call path that launches it, outermost first, each ``module:function``
            (module relative to ``megatron_domino``).
        waited_in: the call path that waits for it, likewise.
        what: what it moves, and who places its launch and wait.
        legs: in backward, where the step has legs (``engine.legs``; the schedule's module
            docstring has the order), which leg's backward launches it and which leg's waits
            for it, and what runs between; empty in forward.
        in_flight: ``False`` for a collective Domino has Transformer Engine issue blocking,
            inside one call (launched and waited there: nothing flies, and the recorder sees
            no launch or wait), on a process group of its own; the traced TE FP8 step finds it
            along ``launched_in``.
    """

    label: str
    kind: str
    direction: str
    launched_in: tuple[str, ...]
    waited_in: tuple[str, ...]
    what: str
    legs: str = ""
    in_flight: bool = True


def _sublayer_sites(sublayer: str, norm_op: str, core_op: str, wait_op: str):
    """The rows of one sub-layer: its norm op ``norm_op`` prepares the column linear's input,
    its core op ``core_op`` runs the column linear, the op ``wait_op`` waits for the row output."""
    labels = SUBLAYER_LABELS[sublayer]
    norm = ("engine.schedule:LayerOps." + norm_op, "engine.schedule:LayerOps._prepare_column_input")
    core = ("engine.schedule:LayerOps." + core_op, "engine.schedule:LayerOps._finish_gather")
    project = ("engine.schedule:LayerOps.projection", "engine.linears:row_projection")
    reduced = ("engine.schedule:LayerOps." + wait_op, "engine.schedule:LayerOps._bias_dropout_add")
    reduced += ("engine.row_output:PendingReduce.wait",)
    column, row = ("QKV", "linear_proj") if sublayer == "attention" else ("fc1", "linear_fc2")
    return (
        CollectiveSite(
            labels.output_ar,
            ALL_REDUCE,
            "fwd",
            (
                *project,
                "engine.row_output:PendingReduce.launch",
                "communication.collectives:ForwardAllReduce.launch",
            ),
            reduced,
            f"{row}'s partial sum [s, b/p, h/k], per column piece; backward: identity",
        ),
        CollectiveSite(
            labels.input_dgrad_ar,
            ALL_REDUCE,
            "bwd",
            (
                "engine.backward_overlap:_ColumnLinearAsyncDgrad.backward",
                "communication.collectives:DgradAllReduce.launch",
            ),
            (
                "engine.backward_overlap:_WaitForDgradReduce.backward",
                "communication.collectives:DgradAllReduce.wait",
            ),
            f"{column}'s input gradient [s, b/p, h]; the wait is placed on its input by "
            f"{norm_op}, the launch by engine.linears:column_parallel_forward (with backward overlap)",
            f"launched last by the leg that begins with {core_op}, waited first by the chunk's "
            f"leg that ends with {norm_op}; the other p - 1 chunks' legs run between",
        ),
        CollectiveSite(
            labels.input_ag,
            ALL_GATHER,
            "fwd",
            (*norm, "communication.sequence_parallel:_GatherLaunch.forward"),
            (*core, "communication.sequence_parallel:_GatherWait.forward"),
            f"SP: {column}'s input [s/tp, b/p, h] -> [s, b/p, h] (FP8 bits under FP8 on TE)",
        ),
        CollectiveSite(
            labels.input_ag,
            REDUCE_SCATTER,
            "bwd",
            ("communication.sequence_parallel:InputGradientScatter.launch",),
            ("communication.sequence_parallel:_GatherLaunch.backward",),
            f"SP: {column}'s input gradient [s, b/p, h] -> [s/tp, b/p, h] ({labels.input_ag}'s "
            "backward twin, same slot), launched between the linear's dgrad and dW GEMMs "
            "(engine.backward_overlap:_ColumnLinearAsyncDgrad.backward; on Transformer "
            "Engine's linear, after its backward: "
            "communication.sequence_parallel:_GatherWait.backward)",
            f"launched last by the leg {core_op} (K), waited first by the chunk's leg {norm_op} "
            "(N); between them another chunk's projection leg (R) at p = 2",
        ),
        CollectiveSite(
            labels.output_rs,
            REDUCE_SCATTER,
            "fwd",
            (
                *project,
                "engine.row_output:PendingReduce.launch",
                "communication.sequence_parallel:_ScatterLaunch.forward",
            ),
            (*reduced, "communication.sequence_parallel:_ScatterWait.forward"),
            f"SP: {row}'s partial sum [s, b/p, h/k] -> [s/tp, b/p, h/k], per column piece",
        ),
        CollectiveSite(
            labels.output_rs,
            ALL_GATHER,
            "bwd",
            ("communication.sequence_parallel:_ScatterWait.backward",),
            ("communication.sequence_parallel:_ScatterLaunch.backward",),
            f"SP: {row}'s output gradient [s/tp, b/p, h/k] -> [s, b/p, h/k] "
            f"({labels.output_rs}'s backward twin, same slot)",
            f"launched last by the leg {wait_op} (N), waited first by the chunk's projection "
            "leg (R); between them another chunk's core leg (K) at p = 2",
        ),
        CollectiveSite(
            labels.input_regather,
            ALL_GATHER,
            "bwd",
            (
                "communication.sequence_parallel:_ScatterWait.backward",
                "communication.saved_shards:SavedInputRegather.launch",
            ),
            (
                "communication.saved_shards:SavedInputRegather._unpack",
                "communication.saved_shards:SavedInputRegather._wait",
            ),
            f"SP: the shard of {column}'s input kept for backward, gathered again (launched "
            "right after the same chunk's output-gradient gather, waited by the first saved "
            "tensor the column linear's backward unpacks)",
            f"launched last by the leg {wait_op} (N), waited inside the chunk's core leg "
            f"{core_op} (K); between them another chunk's core leg and this chunk's projection leg",
        ),
    )


#: Every collective Domino issues: one row per (label, direction). Read a row as "chunk c's
#: ``label`` is launched in ``launched_in`` and waited in ``waited_in``" (module docstring).
COLLECTIVE_SITES: tuple[CollectiveSite, ...] = (
    CollectiveSite(
        EMBEDDING_AR, ALL_REDUCE, "fwd",
        ("engine.embedding_overlap:embedding_forward", "communication.collectives:ForwardAllReduce.launch"),
        ("engine.schedule:LayerOps.attention_norm", "engine.end_handoffs:PendingEmbedding.finish"),
        "the word embedding's partial sum [b/p, s, h], per chunk; waited by layer 0's first op",
    ),
    *_sublayer_sites("attention", "attention_norm", "attention_core", "mlp_norm"),
    *_sublayer_sites("mlp", "mlp_norm", "mlp_core", "finish"),
    CollectiveSite(
        HEAD_DGRAD_AR, ALL_REDUCE, "bwd",
        ("engine.output_head:_OutputLayerChunkedDgrad.backward", "communication.collectives:DgradAllReduce.launch"),
        ("engine.backward_overlap:_WaitForDgradReduce.backward", "communication.collectives:DgradAllReduce.wait"),
        "the output layer's input gradient [s, b/p, h], per chunk, last chunk first; the wait "
        "is placed on the final norm's output by engine.output_head:place_head_wait",
        "launched by the output layer's backward, outside the legs; waited first by each "
        "chunk's last leg (chunk p-1's first, behind the output layer's dW GEMM)",
    ),
    CollectiveSite(
        FP8_AMAX_AR, ALL_REDUCE, "fwd",
        ("engine.schedule:LayerOps._column_input", "communication.te_fp8_inputs:quantized_norm_output"),
        ("engine.schedule:LayerOps._column_input", "communication.te_fp8_inputs:quantized_norm_output"),
        "FP8 current scaling (tensorwise) + SP on TE: the MAX of a chunk's norm output amax "
        "over the TP ranks, one float, before its cast for the input all-gather (TE's cast "
        "runs it blocking); on the amax group, never queued behind the TP group's collectives",
        in_flight=False,
    ),
    CollectiveSite(
        FP8_AMAX_AR, ALL_REDUCE, "bwd",
        ("communication.sequence_parallel:_ScatterWait.backward", "communication.te_fp8_inputs:quantize_shard"),
        ("communication.sequence_parallel:_ScatterWait.backward", "communication.te_fp8_inputs:quantize_shard"),
        "FP8 current scaling (tensorwise) + SP on TE: the MAX of a chunk's row-output gradient "
        "amax over the TP ranks, before its cast for the output-gradient all-gather; blocking, "
        "on the amax group",
        "inside the leg that launches the output-gradient all-gather, just before it",
        in_flight=False,
    ),
)  # fmt: skip


def collective_site(label: str, direction: str) -> CollectiveSite:
    """The row of :data:`COLLECTIVE_SITES` for ``label`` in ``direction``."""
    for site in COLLECTIVE_SITES:
        if site.label == label and site.direction == direction:
            return site
    raise KeyError(f"no collective {label!r} in {direction} in COLLECTIVE_SITES")


class InFlight:
    """A collective (or several launched together, recorded as one) between launch and wait.

    Args:
        group: the tensor-parallel process group.
        label: recorder label (collective name, layer, chunk).
        piece: the column piece it belongs to (row-parallel outputs split into ``k``), else 0.
    """

    def __init__(self, group: dist.ProcessGroup, label: CollectiveLabel, piece: int = 0) -> None:
        self.group = group
        self.label = label
        self.piece = piece
        self._works: list = []
        self._direction = "fwd"
        self._id: int | None = None

    @property
    def pending(self) -> bool:
        """Launched and not yet waited."""
        return bool(self._works)

    def start(self, direction: str, launch: Callable[[], list]) -> None:
        """Run ``launch()``, which starts the collective(s) with ``async_op=True`` and returns
        their handles; record the launch (``direction``: ``fwd`` or ``bwd``)."""
        if self._works:
            label = self.label
            raise RuntimeError(
                f"{label.name} of layer {label.layer} chunk {label.chunk} launched twice "
                "without a wait."
            )
        self._id = self.label.recorder.new_collective_id()
        self._direction = direction
        self._works = list(launch())
        self._record(LAUNCH)

    def finish(self) -> None:
        """Block until every collective of the launch has completed; record the wait."""
        self._record(WAIT_BEGIN)
        for work in self._works:
            work.wait()
        self._record(WAIT_END)
        self._works = []

    def _record(self, kind: str) -> None:
        label = self.label
        label.recorder.record(
            kind, label.name, label.layer, label.chunk, self._direction, self.piece, self._id
        )


class _LaunchAllReduce(torch.autograd.Function):
    """Forward: start the in-place async all-reduce of ``partial``; backward: identity."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, slot: ForwardAllReduce):
        slot.start("fwd", lambda: [dist.all_reduce(partial, group=slot.group, async_op=True)])
        return partial

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return grad_output, None


class ForwardAllReduce(InFlight):
    """One piece of a row-parallel output ``[s, b/p, h/k]``, all-reduced in place.

    :meth:`launch` returns the tensor that holds the sum once :meth:`finish` returned; reading
    it before would read this rank's unreduced partial sum.
    """

    def launch(self, partial: torch.Tensor) -> torch.Tensor:
        """Start the all-reduce of the contiguous ``partial``; its autograd output."""
        return _LaunchAllReduce.apply(partial, self)


class DgradAllReduce(InFlight):
    """The input-gradient all-reduce of one column-parallel linear call for one chunk.

    Created in forward by the schedule, launched by the linear's backward (:meth:`launch`),
    waited by the backward of the identity on the linear's input (:meth:`wait`).
    """

    def __init__(self, group: dist.ProcessGroup, label: CollectiveLabel) -> None:
        super().__init__(group, label)
        self._buffer: torch.Tensor | None = None

    def launch(self, grad_input: torch.Tensor) -> None:
        """Start the in-place all-reduce of ``grad_input`` (``[s, b/p, h]``)."""
        self.start("bwd", lambda: [dist.all_reduce(grad_input, group=self.group, async_op=True)])
        self._buffer = grad_input

    def wait(self, grad: torch.Tensor) -> torch.Tensor:
        """Wait for the all-reduce and return the reduced gradient (``grad`` if none flies).

        ``grad`` must be the very tensor that was launched: if autograd had summed it with
        another consumer's gradient first, that sum would have read an unreduced buffer.
        """
        if not self.pending:
            return grad
        if grad is not self._buffer and grad.data_ptr() != self._buffer.data_ptr():
            raise RuntimeError(
                "Domino backward overlap needs the column-parallel linear to be the only "
                "consumer of its input; another op consumed it, so its gradient was summed "
                "with an in-flight all-reduce buffer. Disable with --no-domino-backward-overlap."
            )
        self.finish()
        reduced, self._buffer = self._buffer, None
        return reduced


def _gathered_shape(shard: torch.Tensor, group: dist.ProcessGroup) -> list[int]:
    return [shard.shape[0] * group.size(), *shard.shape[1:]]


def _scattered_shape(full: torch.Tensor, group: dist.ProcessGroup) -> list[int]:
    return [full.shape[0] // group.size(), *full.shape[1:]]


class SequenceCollective(InFlight):
    """An all-gather or reduce-scatter along the sequence, and its output buffer.

    A slot serves one direction at a time: forward fills and empties it, then backward reuses
    it for the collective that goes the other way.
    """

    def __init__(self, group: dist.ProcessGroup, label: CollectiveLabel, piece: int = 0) -> None:
        super().__init__(group, label, piece)
        self._output: torch.Tensor | None = None

    def all_gather(self, shard: torch.Tensor, direction: str) -> None:
        """Start gathering ``shard`` ``[s/tp, ...]`` into ``[s, ...]`` along the sequence."""
        output = shard.new_empty(_gathered_shape(shard, self.group))
        self._launch(dist.all_gather_into_tensor, output, shard.contiguous(), direction)

    def all_gather_quantized(
        self, quantized: torch.Tensor, quantizer, use: GatherUse, direction: str
    ) -> None:
        """Start gathering the FP8 shard ``quantized`` ``[s/tp, ...]`` (a Transformer Engine FP8
        tensor) into an FP8 ``[s, ...]`` with TE's own all-gather of the buffers ``use`` needs
        (:func:`~megatron_domino.communication.te_fp8_inputs.quantized_gather`)."""

        def launch() -> list:
            self._output, works = quantized_gather(quantized, quantizer, self.group, use)
            return works

        self.start(direction, launch)

    def reduce_scatter(self, full: torch.Tensor, direction: str) -> None:
        """Start summing ``full`` ``[s, ...]`` over ranks, each keeping its ``[s/tp, ...]``."""
        output = full.new_empty(_scattered_shape(full, self.group))
        self._launch(dist.reduce_scatter_tensor, output, full.contiguous(), direction)

    def output_in_flight(self) -> torch.Tensor:
        """The output buffer before the wait: only to hand through autograd, never to read."""
        return self._output

    def wait(self) -> torch.Tensor:
        """Wait for the collective; its output."""
        self.finish()
        output, self._output = self._output, None
        return output

    def _launch(self, collective, output: torch.Tensor, tensor: torch.Tensor, direction: str):
        def launch() -> list:
            return [collective(output, tensor, group=self.group, async_op=True)]

        self.start(direction, launch)
        self._output = output
