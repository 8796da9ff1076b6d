"""Sequence parallelism's memory saving, kept: a column linear saves its input shard only.

Under sequence parallelism stock Megatron's column-parallel linear keeps, for backward, this
rank's shard ``[s/tp, b, h]`` of its input and all-gathers it again in backward. Domino runs
the linear on an input it gathered ahead (:mod:`megatron_domino.communication.sequence_parallel`), so
autograd would keep the whole gathered sequence. :class:`SavedInputRegather`, around the
linear's call (:func:`keeping_input_shards`), keeps this rank's rows instead and gathers them
again in backward. That all-gather is launched by the backward of the same chunk's row-output
wait (created one op after the column linear), right after its own dY gather, and waited where
the column linear's backward needs its input: another chunk's core op runs in between.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron_domino.base.recorder import CollectiveLabel
from megatron_domino.communication.collectives import InFlight
from megatron_domino.communication.te_fp8_inputs import (
    GatherUse,
    keep_wgrad_buffers,
    quantized_gather,
)

__all__ = ["SavedInputRegather", "keeping_input_shards"]


class SavedInputRegather(InFlight):
    """What one chunk's column-parallel linear keeps of its gathered input, and its re-gather.

    Stock Megatron's column linear (and TE's fused norm + linear) under sequence parallelism
    keeps this rank's shard ``[s/tp, b, h]`` for backward and all-gathers it again there.
    Domino calls the linear on the input it gathered ahead, ``[s, b/p, h]``, so autograd would
    keep the full sequence: per layer and micro-batch ``2 (1 - 1/tp) s b h`` elements more
    (QKV and fc1; more with TE, whose norm output is kept too). Wrapping the call in
    :meth:`keeping_shards` keeps, of every tensor the call saves that spans the gathered
    sequence, only this rank's rows:

    * the gathered input, or a view of it: the shard it was gathered from (``shard``, no copy);
    * another tensor that is provably a per-token function of the gathered input: TE's norm
      output, or an intermediate of a torch norm. Everything the call computes from its input
      before the GEMM is the same on every TP rank, so this rank's rows (a copy) gathered
      again give it back. A tensor counts as one only if it is a plain ``torch.Tensor`` of the
      gathered input's size and (floating) dtype, contiguous, with its leading dimension over
      the tokens (``[s, b/p, h]`` or ``[s*b/p, h]``), and not shaped like any parameter of the
      called module (nor its transpose). A torch norm's fp32 intermediate on bf16 input is
      therefore kept whole (Transformer Engine's fused norm keeps none: its norm output has the
      input's dtype, its statistics are ``[s*b/p]``).

    Everything else is kept as it is: parameters, subclassed tensors (a cached FP8 weight),
    per-token statistics ``[s*b/p]``, and whatever may be rank-specific. Transformer Engine
    saves an uncached FP8 weight as plain ``uint8`` tensors ``_data [n/tp, h]`` and
    ``_transpose [h, n/tp]``, different on every rank (TE ``tensor/storage/
    float8_tensor_storage.py:145-151``), and a bf16 cast of an fp32 weight is plain and
    rank-specific too: when ``n/tp == h ==`` tokens per chunk their size and leading dimension
    match the gathered input's, so only the dtype and shape rules keep them whole (re-gathered,
    they would come back stitched from other ranks' weights, and the input gradient with them).

    In backward, :meth:`launch` starts the all-gathers (one per kept tensor, recorded as one
    collective ``<sublayer>_regather``); the first access to a saved tensor waits for them (and
    launches them first if nothing did). The pack and unpack hooks pass what they keep on to
    the saved-tensor hooks that were active when the call began (e.g. a memory measurement).

    Under FP8 on Transformer Engine layers the gathered input is an FP8 tensor (TE's
    ``Float8Tensor``, gathered from ``quantized``, :mod:`megatron_domino.communication.te_fp8_inputs`), which
    TE saves as it is: it is kept as ``quantized``, this rank's FP8 shard, and gathered again in
    FP8 by TE's own all-gather, as stock TE keeps and gathers its FP8 shard.

    Args:
        group: the tensor-parallel group.
        label: recorder label (``<sublayer>_regather``, layer, chunk).
        shard: the column linear's input before the all-gather, ``[s/tp, b/p, h]``.
        quantized: ``shard`` cast to FP8 (row-wise) when the FP8 cast was gathered, else
            ``None``.
        quantizer: the quantizer that cast it.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        label: CollectiveLabel,
        shard: torch.Tensor,
        quantized: torch.Tensor | None = None,
        quantizer=None,
    ):
        super().__init__(group, label)
        # Under FP8 only the FP8 shard is kept: the bf16 one is the norm's, freed after the
        # forward, as stock keeps only its 1-byte shard (TE ``module/linear.py:564-569``).
        self._shard = shard.detach() if quantized is None else None
        self._quantized, self._quantizer = quantized, quantizer
        self._gathered: torch.Tensor | None = None
        self._parameter_shapes: set[tuple[int, ...]] = set()
        self._outer = None
        #: per kept tensor: (this rank's rows or what the outer pack hook made of them,
        #: full shape, the FP8 quantizer of an FP8 shard or None); the gathered input's own
        #: shard is at ``_view_index`` once the input (a view of it, or the FP8 input) was saved.
        self._kept: list[tuple[object, torch.Size, object]] = []
        self._view_index: int | None = None
        self._uses: list[int] = []
        self._outputs: list[torch.Tensor] = []
        self._ready: dict[int, torch.Tensor] = {}
        self._unpacked: list[int] = []

    @contextlib.contextmanager
    def keeping_shards(self, gathered: torch.Tensor, module: torch.nn.Module) -> Iterator[None]:
        """Around ``module``'s call (the column linear) on ``gathered`` ``[s, b/p, h]``: keep
        shards only."""
        self._gathered = gathered
        self._parameter_shapes = {
            shape
            for param in module.parameters()
            for shape in (tuple(param.shape), tuple(reversed(param.shape)))
        }
        # The (pack, unpack) pair active now, or None: torch's private query, also used by
        # torch._functorch; the public context manager can only push and pop.
        self._outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._gathered, self._parameter_shapes = None, set()
        if self._quantized is not None:  # the call consumed the forward's gather
            keep_wgrad_buffers(self._quantized, self._quantizer)

    def launch(self) -> None:
        """Start re-gathering every kept tensor (backward, ahead of the linear's backward)."""
        if self._launched or not self._kept:
            return
        self.start("bwd", self._gather_kept)

    @property
    def _launched(self) -> bool:
        """Launched and not yet waited: handles in flight, or outputs of a gather that TE made
        synchronously (no handle: its block-scaled gather of a shape it cannot cast)."""
        return self.pending or bool(self._outputs)

    def _gather_kept(self) -> list:
        works = []
        for kept, full_shape, quantizer in self._kept:
            rows = self._outer[1](kept) if self._outer else kept
            if quantizer is not None:
                output, launched = quantized_gather(
                    rows, quantizer, self.group, GatherUse.WGRAD_INPUT
                )
                works.extend(launched)
            else:
                output = rows.new_empty(full_shape)
                works.append(
                    dist.all_gather_into_tensor(
                        output, rows.contiguous(), group=self.group, async_op=True
                    )
                )
            self._outputs.append(output)
        return works

    def _wait(self) -> None:
        if not self._launched:
            self.launch()
        self.finish()
        self._ready = dict(enumerate(self._outputs))
        self._unpacked = [0] * len(self._kept)
        self._outputs = []

    def _pack(self, tensor: torch.Tensor):
        gathered = self._gathered
        if self._quantized is not None:  # the FP8 input: nothing else is of its tokens
            if not _same_fp8_bits(tensor, gathered):
                return self._pass(tensor)
            if self._view_index is None:
                self._view_index = self._keep(self._quantized, gathered.shape, self._quantizer)
            self._uses[self._view_index] += 1
            return ("quantized", self._view_index, None)
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
        if self._per_token(tensor):
            size = self.group.size()
            rows = tensor.shape[0] // size
            mine = tensor.detach().narrow(0, self.group.rank() * rows, rows).clone()
            index = self._keep(mine, tensor.shape)
            self._uses[index] += 1
            return ("rows", index, None)
        return self._pass(tensor)

    def _per_token(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (plain, not a view of the gathered input) is provably a per-token
        function of the gathered input (class docstring): same size and dtype (a floating
        one), tokens first, contiguous, and not parameter-shaped."""
        gathered = self._gathered
        s, b = gathered.shape[0], gathered.shape[1]
        return (
            tensor.dtype == gathered.dtype
            and tensor.numel() == gathered.numel()
            and tensor.is_contiguous()
            and tensor.shape[0] in (s, s * b)
            and tensor.shape[-1] == gathered.shape[-1]
            and tuple(tensor.shape) not in self._parameter_shapes
        )

    def _keep(self, rows: torch.Tensor, full_shape: torch.Size, quantizer=None) -> int:
        self._kept.append((self._outer[0](rows) if self._outer else rows, full_shape, quantizer))
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


def _rowwise_bits(tensor: torch.Tensor):
    """TE's row-wise FP8 bits of ``tensor`` (``_data`` per-tensor, ``_rowwise_data`` block-scaled),
    or ``None``."""
    bits = getattr(tensor, "_data", None)
    return bits if bits is not None else getattr(tensor, "_rowwise_data", None)


def _same_fp8_bits(tensor: torch.Tensor, gathered: torch.Tensor) -> bool:
    """Whether ``tensor`` is the gathered FP8 input (or an alias of it): its row-wise FP8 bits
    are the gathered input's."""
    bits, gathered_bits = _rowwise_bits(tensor), _rowwise_bits(gathered)
    return (
        isinstance(bits, torch.Tensor)
        and isinstance(gathered_bits, torch.Tensor)
        and bits.untyped_storage().data_ptr() == gathered_bits.untyped_storage().data_ptr()
    )


def keeping_input_shards(
    regather: SavedInputRegather | None, gathered: torch.Tensor, module: torch.nn.Module
):
    """Around column linear ``module``'s call on ``gathered`` ``[s, b/p, h]``: keep only this
    rank's shards for backward (:meth:`SavedInputRegather.keeping_shards`); a no-op without a
    ``regather`` (autograd off)."""
    if regather is None:
        return contextlib.nullcontext()
    return regather.keeping_shards(gathered, module)
