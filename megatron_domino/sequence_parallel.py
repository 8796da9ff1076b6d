"""Sequence-parallel collectives for Domino: all-gathers and reduce-scatters in flight.

Under sequence parallelism the residual stream is ``[s/tp, b, h]``: each tensor-parallel rank
holds ``s/tp`` tokens. A column-parallel linear needs the whole sequence, so its input is
all-gathered along ``s``; a row-parallel linear's partial sums ``[s, b, h]`` are reduce-scattered
back to ``[s/tp, b, h]``. In backward the roles swap: the column linear's input gradient is
reduce-scattered, the row linear's output gradient all-gathered.

Each collective is split into two autograd nodes, created at the two points of the schedule
where Domino launches and waits it in forward (another chunk's op is created in between):

* :class:`_GatherLaunch` (norm op) / :class:`_GatherWait` (core op): the forward all-gather of
  a column linear's input; in backward, ``_GatherWait`` launches the reduce-scatter of the
  input gradient right after the linear's backward, ``_GatherLaunch`` waits for it.
* :class:`_ScatterLaunch` (projection op) / :class:`_ScatterWait` (next norm op): the forward
  reduce-scatter of a row linear's output; in backward, ``_ScatterWait`` launches the
  all-gather of the output gradient, ``_ScatterLaunch`` waits for it.

The autograd engine runs the other chunk's nodes (created between the pair) while each
backward collective flies, as for the input-gradient all-reduce without sequence parallelism.

A third collective per column linear keeps sequence parallelism's memory saving: the linear
runs on the gathered ``[s, b/p, h]`` but, like stock Megatron, keeps only this rank's shard
for backward and gathers it again there (:class:`SavedInputRegather`). That backward
all-gather is launched by the ``_ScatterWait`` of the same chunk's row-linear output (created
one op after the column linear), right after its own dY gather, and waited where the column
linear's backward needs its input: another chunk's core op runs in between.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from megatron_domino.recorder import LAUNCH, WAIT_BEGIN, WAIT_END, CollectiveLabel


def _gathered_shape(shard: torch.Tensor, group: dist.ProcessGroup) -> list[int]:
    return [shard.shape[0] * group.size(), *shard.shape[1:]]


def _scattered_shape(full: torch.Tensor, group: dist.ProcessGroup) -> list[int]:
    return [full.shape[0] // group.size(), *full.shape[1:]]


class SequenceCollective:
    """One collective in flight: its handle, output buffer and recorder bookkeeping.

    A slot serves one direction at a time: forward fills and empties it, then backward reuses
    it for the collective that goes the other way.
    """

    def __init__(self, group: dist.ProcessGroup, label: CollectiveLabel, piece: int = 0) -> None:
        self.group = group
        self.label = label
        self.piece = piece
        self._work = None
        self._output: torch.Tensor | None = None
        self._id: int | None = None

    @property
    def pending(self) -> bool:
        return self._work is not None

    def all_gather(self, shard: torch.Tensor, direction: str) -> None:
        """Start gathering ``shard`` ``[s/tp, ...]`` into ``[s, ...]`` along the sequence."""
        output = shard.new_empty(_gathered_shape(shard, self.group))
        self._start(dist.all_gather_into_tensor, output, shard.contiguous(), direction)

    def reduce_scatter(self, full: torch.Tensor, direction: str) -> None:
        """Start summing ``full`` ``[s, ...]`` over ranks, each keeping its ``[s/tp, ...]``."""
        output = full.new_empty(_scattered_shape(full, self.group))
        self._start(dist.reduce_scatter_tensor, output, full.contiguous(), direction)

    def output_in_flight(self) -> torch.Tensor:
        """The output buffer before the wait: only to hand through autograd, never to read."""
        return self._output

    def wait(self, direction: str) -> torch.Tensor:
        label = self.label
        rec = label.recorder
        rec.record(
            WAIT_BEGIN, label.name, label.layer, label.chunk, direction, self.piece, self._id
        )
        self._work.wait()
        rec.record(WAIT_END, label.name, label.layer, label.chunk, direction, self.piece, self._id)
        output, self._work, self._output = self._output, None, None
        return output

    def _start(
        self, collective, output: torch.Tensor, tensor: torch.Tensor, direction: str
    ) -> None:
        if self._work is not None:
            raise RuntimeError(
                f"{self.label.name} of layer {self.label.layer} chunk "
                f"{self.label.chunk} launched twice without a wait."
            )
        label = self.label
        self._id = label.recorder.new_collective_id()
        self._output = output
        self._work = collective(output, tensor, group=self.group, async_op=True)
        label.recorder.record(
            LAUNCH, label.name, label.layer, label.chunk, direction, self.piece, self._id
        )


class _GatherLaunch(torch.autograd.Function):
    """Forward: launch the all-gather of the norm output; backward: wait for the dX scatter."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, slot: SequenceCollective):
        ctx.slot = slot
        slot.all_gather(shard, "fwd")
        return shard.view_as(shard)

    @staticmethod
    def backward(ctx, grad_in_flight: torch.Tensor):
        if grad_in_flight.data_ptr() != ctx.slot.output_in_flight().data_ptr():
            raise RuntimeError(
                "Domino sequence parallelism needs the column-parallel linear to be the only "
                "consumer of its gathered input; another op consumed it."
            )
        return ctx.slot.wait("bwd"), None


class _GatherWait(torch.autograd.Function):
    """Forward: wait for the all-gather (``[s, b/p, h]``); backward: launch the dX scatter."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, slot: SequenceCollective):
        ctx.slot = slot
        return slot.wait("fwd")

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        ctx.slot.reduce_scatter(grad_full, "bwd")
        return ctx.slot.output_in_flight(), None


class _ScatterLaunch(torch.autograd.Function):
    """Forward: launch the reduce-scatter of a partial sum; backward: wait for the dY gather."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, slot: SequenceCollective):
        ctx.slot = slot
        slot.reduce_scatter(partial, "fwd")
        return slot.output_in_flight()

    @staticmethod
    def backward(ctx, grad_in_flight: torch.Tensor):
        return ctx.slot.wait("bwd"), None


class _ScatterWait(torch.autograd.Function):
    """Forward: wait for the reduce-scatter (``[s/tp, ...]``); backward: launch the dY gather,
    then ``then`` (the re-gather of the chunk's column-linear input, if any)."""

    @staticmethod
    def forward(ctx, in_flight: torch.Tensor, slot: SequenceCollective, then):
        ctx.slot, ctx.then = slot, then
        return slot.wait("fwd").view_as(in_flight)

    @staticmethod
    def backward(ctx, grad_shard: torch.Tensor):
        # The gathered gradient reaches _ScatterLaunch through the slot; autograd needs a
        # gradient of the shard's shape on this edge, which _ScatterLaunch ignores.
        ctx.slot.all_gather(grad_shard, "bwd")
        if ctx.then is not None:
            ctx.then()
        return grad_shard, None, None


def launch_gather(shard, slot):
    """Norm op: start the all-gather of ``shard`` ``[s/tp, b/p, h]``."""
    return _GatherLaunch.apply(shard, slot)


def wait_gather(launched, slot):
    """Core op: the gathered input ``[s, b/p, h]`` of the column-parallel linear."""
    return _GatherWait.apply(launched, slot)


def launch_scatter(partial, slot):
    """Projection op: start the reduce-scatter of ``partial`` ``[s, b/p, h/k]``."""
    return _ScatterLaunch.apply(partial, slot)


def wait_scatter(in_flight, slot, then: Callable[[], None] | None = None):
    """Next norm op: the reduced shard ``[s/tp, b/p, h/k]``; ``then`` runs in backward right
    after the dY gather is launched."""
    return _ScatterWait.apply(in_flight, slot, then)


class SavedInputRegather:
    """What one chunk's column-parallel linear keeps of its gathered input, and its re-gather.

    Stock Megatron's column linear (and TE's fused norm + linear) under sequence parallelism
    keeps this rank's shard ``[s/tp, b, h]`` for backward and all-gathers it again there.
    Domino calls the linear on the input it gathered ahead, ``[s, b/p, h]``, so autograd would
    keep the full sequence: per layer and micro-batch ``2 (1 - 1/tp) s b h`` elements more
    (QKV and fc1; more with TE, whose norm output is kept too). Wrapping the call in
    :meth:`keeping_shards` keeps, of every tensor the call saves that spans the gathered
    sequence, only this rank's rows:

    * the gathered input, or a view of it: the shard it was gathered from (``shard``, no copy);
    * another plain tensor of the gathered input's size whose leading dimension runs over its
      tokens (``[s, b/p, h]`` or ``[s*b/p, h]``; contiguous): TE's norm output, or an
      intermediate of a torch norm. Everything the call computes before its GEMM is a
      per-token function of the gathered input, the same on every TP rank, so this rank's
      rows (a copy) gathered again give it back. What is rank-specific (the weight, the GEMM
      output) is a parameter or has another size, and is kept as it is, as are subclassed
      tensors (FP8) and per-token statistics ``[s*b/p]``.

    In backward, :meth:`launch` starts the all-gathers (one per kept tensor, recorded as one
    collective ``<sublayer>_regather``); the first access to a saved tensor waits for them (and
    launches them first if nothing did). The pack and unpack hooks pass what they keep on to
    the saved-tensor hooks that were active when the call began (e.g. a memory measurement).

    Args:
        group: the tensor-parallel group.
        label: recorder label (``<sublayer>_regather``, layer, chunk).
        shard: the column linear's input before the all-gather, ``[s/tp, b/p, h]``.
    """

    def __init__(self, group: dist.ProcessGroup, label: CollectiveLabel, shard: torch.Tensor):
        self.group = group
        self.label = label
        self._shard = shard.detach()
        self._gathered: torch.Tensor | None = None
        self._outer = None
        #: per kept tensor: (this rank's rows or what the outer pack hook made of them,
        #: full shape); index 0 is the gathered input's own shard once a view of it was saved.
        self._kept: list[tuple[object, torch.Size]] = []
        self._view_index: int | None = None
        self._uses: list[int] = []
        self._works: list = []
        self._outputs: list[torch.Tensor] = []
        self._ready: dict[int, torch.Tensor] = {}
        self._unpacked: list[int] = []
        self._id: int | None = None

    @property
    def pending(self) -> bool:
        return bool(self._works)

    @contextlib.contextmanager
    def keeping_shards(self, gathered: torch.Tensor) -> Iterator[None]:
        """Around the column linear's call on ``gathered`` ``[s, b/p, h]``: keep shards only."""
        self._gathered = gathered
        # The (pack, unpack) pair active now, or None: torch's private query, also used by
        # torch._functorch; the public context manager can only push and pop.
        self._outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._gathered = None

    def launch(self) -> None:
        """Start re-gathering every kept tensor (backward, ahead of the linear's backward)."""
        if self._works or not self._kept:
            return
        label = self.label
        self._id = label.recorder.new_collective_id()
        for kept, full_shape in self._kept:
            rows = self._outer[1](kept) if self._outer else kept
            output = rows.new_empty(full_shape)
            self._outputs.append(output)
            self._works.append(
                dist.all_gather_into_tensor(
                    output, rows.contiguous(), group=self.group, async_op=True
                )
            )
        label.recorder.record(LAUNCH, label.name, label.layer, label.chunk, "bwd", 0, self._id)

    def _wait(self) -> None:
        if not self._works:
            self.launch()
        label = self.label
        rec = label.recorder
        rec.record(WAIT_BEGIN, label.name, label.layer, label.chunk, "bwd", 0, self._id)
        for work in self._works:
            work.wait()
        rec.record(WAIT_END, label.name, label.layer, label.chunk, "bwd", 0, self._id)
        self._ready = dict(enumerate(self._outputs))
        self._unpacked = [0] * len(self._kept)
        self._works, self._outputs = [], []

    def _pack(self, tensor: torch.Tensor):
        gathered = self._gathered
        if type(tensor) is not torch.Tensor or tensor.device != gathered.device:
            return self._pass(tensor)
        if tensor.untyped_storage().data_ptr() == gathered.untyped_storage().data_ptr():
            if (
                tensor.dtype != gathered.dtype
                or not gathered.is_contiguous()
                or gathered.storage_offset() != 0
            ):
                return self._pass(tensor)
            if self._view_index is None:
                self._view_index = self._keep(self._shard, gathered.shape)
            self._uses[self._view_index] += 1
            geometry = (tensor.size(), tensor.stride(), tensor.storage_offset())
            return ("view", self._view_index, geometry)
        s, b = gathered.shape[0], gathered.shape[1]
        if (
            tensor.numel() == gathered.numel()
            and tensor.is_contiguous()
            and tensor.shape[0] in (s, s * b)
            and tensor.shape[-1] == gathered.shape[-1]
        ):
            size = self.group.size()
            rows = tensor.shape[0] // size
            mine = tensor.detach().narrow(0, self.group.rank() * rows, rows).clone()
            index = self._keep(mine, tensor.shape)
            self._uses[index] += 1
            return ("rows", index, None)
        return self._pass(tensor)

    def _keep(self, rows: torch.Tensor, full_shape: torch.Size) -> int:
        self._kept.append((self._outer[0](rows) if self._outer else rows, full_shape))
        self._uses.append(0)
        return len(self._kept) - 1

    def _pass(self, tensor: torch.Tensor):
        return ("pass", None, self._outer[0](tensor) if self._outer else tensor.detach())

    def _unpack(self, packed) -> torch.Tensor:
        kind, index, payload = packed
        if kind == "pass":
            return self._outer[1](payload) if self._outer else payload
        if index not in self._ready:
            self._wait()
        full = self._ready[index]
        self._unpacked[index] += 1
        if self._unpacked[index] >= self._uses[index]:
            del self._ready[index]  # the last saved tensor that needs it: free it with them
        if kind == "view":
            size, stride, offset = payload
            return full.as_strided(size, stride, offset)
        return full


def keeping_input_shards(regather: SavedInputRegather | None, gathered: torch.Tensor):
    """Around a column linear's call on ``gathered`` ``[s, b/p, h]``: keep only this rank's
    shards for backward (:meth:`SavedInputRegather.keeping_shards`); a no-op without a
    ``regather`` (autograd off)."""
    if regather is None:
        return contextlib.nullcontext()
    return regather.keeping_shards(gathered)
