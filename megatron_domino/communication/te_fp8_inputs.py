"""Under FP8 and sequence parallelism, the TP gathers of Transformer Engine layers in FP8, as stock.

Forward: stock's fused ``TELayerNormColumnParallelLinear`` norms this rank's shard ``[s/tp, b,
h]`` and casts the norm's **fp32** result straight to FP8 with the linear's input quantizer (one
rounding: TE ``module/layernorm_linear.py:233-253``, its fused norm kernel), then all-gathers
the FP8 bits (``distributed.py:982-1073``): half the bytes of a bf16 gather. Domino gathers that
input itself, ahead of the call and behind another chunk's work
(:mod:`megatron_domino.communication.sequence_parallel`), on the layer with its norms apart
(:mod:`megatron_domino.specs.te_spec`), so it casts the same way:
:func:`~megatron_domino.communication.te_quantizers.fp8_input_quantizer` finds the quantizer
TE's call would use, :func:`quantized_norm_output` calls the TE norm module once on the shard
with that quantizer as its output quantizer (the fp32 result cast once, as the fused module
does; the FP8 output carries the gradient, no bf16 norm output is made), and
:func:`quantized_gather` starts TE's own all-gather of its FP8 bits. The call then gets an FP8
tensor ``[s, b/p, h]``, which TE uses as it is (``linear.py:384-386``), and saves as it is (the
``"inp"`` alias, ``linear.py:606-616``): :mod:`megatron_domino.communication.saved_shards` keeps
this rank's FP8 shard of it instead (and nothing of the bf16 one) and gathers it again in
backward, as stock keeps its FP8 shard (``linear.py:565-569``, ``928-955``).

Backward: stock's ``TERowParallelLinear`` casts its output gradient's shard to FP8 with its
grad-output quantizer and all-gathers the FP8 bits (``module/base.py:1636, 1653-1684``). Domino
gathers that gradient itself (the reduce-scatter's backward twin), so it casts it with the same
quantizer first (:func:`~megatron_domino.communication.te_quantizers.fp8_grad_output_quantizer`)
and hands TE's backward the gathered FP8 gradient, which TE uses as it is: the same bytes as
stock in both directions.

The quantizer's settings change for the cast and the gather, and are restored after
(:func:`_gathered_cast`). Under delayed scaling the scale is the one the call itself would use,
the same on every rank and every chunk of the micro-batch. Under current scaling
(``--fp8-recipe tensorwise``) each cast takes the amax of what it casts, reduced over the TP
group as stock's SP gathers reduce it: so each **chunk** is cast with its own scale (the
chunk's amax over all ranks), where stock casts the whole micro-batch with one; that is the one
numerical difference from stock, held to stock's own FP8 error by the tests. Under block
scaling (``--fp8-recipe blockwise``) the activations' 1 x 128 tiles run along ``h``, so the
forward's casts are stock's whatever the chunks; the 128 x 1 tiles of the weight-gradient
inputs run along the tokens, where a chunk boundary cuts them.

What has run where: on TE 2.18's own Python over the test suite's CPU backend of its
extension (``tests/te_cpu``: GEMMs, casts and norm kernels modelled in torch); not yet on a GPU.
"""

from __future__ import annotations

import contextlib
import enum
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist

__all__ = [
    "GatherUse",
    "casts_reduce_amax",
    "keep_wgrad_buffers",
    "quantize_shard",
    "quantized_gather",
    "quantized_norm_output",
]


def casts_reduce_amax(config) -> bool:
    """Whether a model with TransformerConfig ``config`` runs gathered casts that reduce their
    amax over the TP ranks: FP8 current scaling (``--fp8-recipe tensorwise``) under sequence
    parallelism. Those reductions run on a group of their own
    (:mod:`megatron_domino.runtime.amax_group`), which callers pass to
    :func:`quantized_norm_output` and :func:`quantize_shard`."""
    return bool(config.fp8) and config.fp8_recipe == "tensorwise" and config.sequence_parallel


class GatherUse(enum.Enum):
    """What a gathered FP8 tensor is for, and so which of its buffers ``(row-wise, column-wise)``
    a cast makes and a gather moves, as TE's own SP paths choose them: the forward's GEMM reads
    the input row-wise (TE ``module/linear.py:368-371``, ``layernorm_linear.py:283-287``); the
    backward's re-gather of the saved input feeds the weight-gradient GEMM, which reads it
    column-wise (``linear.py:931-937``, ``layernorm_linear.py:749-754``); the output gradient
    feeds both GEMMs; a cast of a shard to be gathered makes both buffers (the forward gather
    takes one, the backward re-gather the other). A per-tensor scaled quantizer gathers its
    row-wise bits only (TE makes the transpose after the gather), whatever the use.

    Each value is ``(row-wise, column-wise, what for)``: the last part keeps two uses with the
    same buffers distinct members (an enum makes equal values aliases)."""

    CAST_SHARD = (True, True, "a shard's cast, for its forward gather and backward re-gather")
    FPROP_INPUT = (True, False, "the forward GEMM's input")
    WGRAD_INPUT = (False, True, "the weight-gradient GEMM's input")
    GRAD_OUTPUT = (True, True, "the output gradient, for both backward GEMMs")

    @property
    def buffers(self) -> tuple[bool, bool]:
        """``(row-wise, column-wise)``."""
        return self.value[:2]


def _buffers(quantizer, use: GatherUse) -> tuple[bool, bool]:
    """``(row-wise, column-wise)``: the buffers ``quantizer`` casts or gathers for ``use``."""
    return (True, False) if quantizer.supports_only_rowwise_all_gather() else use.buffers


def keep_wgrad_buffers(quantized: torch.Tensor, quantizer) -> None:
    """Of the FP8 shard ``quantized`` ``[s/tp, b/p, h]``, once its forward gather is done, keep
    only the buffers its backward re-gather moves (:attr:`GatherUse.WGRAD_INPUT`), as TE
    frees the row-wise buffers of the block-scaled shard it saves (``module/linear.py:555-566``,
    ``layernorm_linear.py:463-469``): the FP8 shard Domino keeps is then stock's size."""
    rowwise, columnwise = _buffers(quantizer, GatherUse.WGRAD_INPUT)
    quantized.update_usage(rowwise_usage=rowwise, columnwise_usage=columnwise)


@contextlib.contextmanager
def _gathered_cast(
    quantizer, use: GatherUse, group: dist.ProcessGroup | None = None
) -> Iterator[None]:
    """Inside, ``quantizer`` casts or gathers a shard for ``use`` (its settings restored after):
    tensors autograd can carry (``internal`` off), the buffers ``use`` names (only row-wise
    where the quantizer supports only row-wise all-gathers), and for a current-scaling
    quantizer, given ``group`` (the TP ranks' amax group, :mod:`megatron_domino.runtime.amax_group`),
    the amax reduced over it, as TE's ``set_quantizer_amax_reduction_group`` reduces it over the
    TP group for a column linear's input or a row linear's output gradient under SP: every rank
    casts its shard with one scale, so the gathered tensor has one. Delayed scaling's scale is
    the same on every rank already."""
    saved = quantizer.internal, quantizer.rowwise_usage, quantizer.columnwise_usage
    reduces = group is not None and hasattr(quantizer, "with_amax_reduction")
    if reduces:
        reduction = quantizer.with_amax_reduction, quantizer.amax_reduction_group
        quantizer.with_amax_reduction, quantizer.amax_reduction_group = True, group
    quantizer.internal = False
    rowwise, columnwise = _buffers(quantizer, use)
    quantizer.set_usage(rowwise=rowwise, columnwise=columnwise)
    try:
        yield
    finally:
        quantizer.internal = saved[0]
        quantizer.set_usage(rowwise=saved[1], columnwise=saved[2])
        if reduces:
            quantizer.with_amax_reduction, quantizer.amax_reduction_group = reduction


def _amax_group(quantizer, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group``, checked: a current-scaling ``quantizer`` reduces its amax, and must be told
    over which group (never the TP group, where Domino's collectives are in flight)."""
    if group is None and hasattr(quantizer, "with_amax_reduction"):
        raise RuntimeError(
            "Domino bug: a current-scaling FP8 cast needs the runtime's amax group "
            "(megatron_domino.runtime.amax_group); none was made for this model."
        )
    return group


def quantize_shard(
    quantizer, shard: torch.Tensor, amax_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """``shard`` ``[s/tp, b/p, h]`` cast to FP8 for a gather over the TP group (the buffers
    that gather takes, :func:`_gathered_cast`; a current-scaling cast's amax reduced over
    ``amax_group``), as a tensor subclass (no autograd: the gradient reaches ``shard`` through
    Domino's gather nodes)."""
    with (
        torch.no_grad(),
        _gathered_cast(quantizer, GatherUse.CAST_SHARD, _amax_group(quantizer, amax_group)),
    ):
        return quantizer(shard)


def quantized_norm_output(
    norm: torch.nn.Module, hidden: torch.Tensor, quantizer, amax_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """TE norm ``norm`` (Megatron's ``TENorm``, a TE ops module) on ``hidden`` ``[s/tp, b/p, h]``,
    called once as a module (its hooks run, as DDP's parameter gather needs), its fp32 result
    cast to FP8 by ``quantizer`` in the norm kernel (one rounding, as the fused module's norm)
    for a gather over the TP group (a current-scaling cast's amax reduced over
    ``amax_group``): a row-wise ``Float8Tensor`` that carries the gradient through TE's own
    norm backward.

    TE's op fuser hands a norm op the input quantizer of the op after it
    (``next_op_input_quantizer``, TE ``ops/fuser.py``); a norm called alone has none, so for
    this one call the norm's ``op_forward`` is given ``quantizer`` as that argument.
    """
    op_forward = norm.op_forward

    def casting_op_forward(ctx, input_, *args, **kwargs):
        kwargs["next_op_input_quantizer"] = quantizer
        return op_forward(ctx, input_, *args[:1], **kwargs)

    norm.op_forward = casting_op_forward
    try:
        with _gathered_cast(quantizer, GatherUse.CAST_SHARD, _amax_group(quantizer, amax_group)):
            return norm(hidden)
    finally:
        del norm.op_forward


def _te_gather_along_first_dim():
    """TE's FP8-aware all-gather (``transformer_engine.pytorch.distributed``)."""
    from transformer_engine.pytorch.distributed import gather_along_first_dim

    return gather_along_first_dim


#: TE's ``gather_along_first_dim``, imported on first use (Domino imports no TE before a TE
#: layer runs).
gather_along_first_dim = None


class SynchronousGatherWarning(UserWarning):
    """TE gathered a tensor synchronously where Domino asked for an asynchronous gather."""


#: Whether :class:`SynchronousGatherWarning` was issued in this process (it is, once).
_warned_synchronous = False


def quantized_gather(quantized: torch.Tensor, quantizer, group: dist.ProcessGroup, use: GatherUse):
    """Start the all-gather of the FP8 shard ``quantized`` ``[s/tp, b/p, h]`` with TE's own
    function, moving the buffers ``use`` needs and no more: ``(output [s, b/p, h] FP8 tensor,
    to read after the handle's wait, [handle])``.

    TE's FP8 block all-gather (``--fp8-recipe blockwise``) needs the tokens of the shard
    (``s/tp x b/p``, the rows of its 1 x 128 tiles' scale layout) to be a multiple of 128;
    otherwise TE gathers the tensor in bf16, synchronously, and returns no handle: the gather
    cannot overlap anything. That is said once per process
    (:class:`SynchronousGatherWarning`), naming the shape rule."""
    global gather_along_first_dim, _warned_synchronous
    if gather_along_first_dim is None:
        gather_along_first_dim = _te_gather_along_first_dim()
    with _gathered_cast(quantizer, use):
        output, handle = gather_along_first_dim(
            quantized, group, async_op=True, quantizer=quantizer
        )
    if handle is None and not _warned_synchronous:
        _warned_synchronous = True
        tokens = quantized.numel() // quantized.shape[-1]
        warnings.warn(
            f"Domino: Transformer Engine gathered a {type(quantized).__name__} shard of "
            f"{tokens} tokens synchronously (in bf16): its FP8 block all-gather "
            "(--fp8-recipe blockwise) needs the tokens per rank and chunk "
            "(seq-length / TP x micro-batch / domino-chunks, or seq-length / (TP x "
            "domino-chunks) with --domino-split sequence) to be a multiple of 128, so this "
            "gather and its re-gather in backward overlap nothing. Choose shapes that satisfy "
            "it (real training shapes do), or --fp8-recipe delayed/tensorwise.",
            SynchronousGatherWarning,
            stacklevel=2,
        )
    return output, [handle] if handle is not None else []
