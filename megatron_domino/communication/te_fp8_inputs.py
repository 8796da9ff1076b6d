"""Under FP8 and sequence parallelism, the TP gathers of Transformer Engine layers in FP8, as stock.

Forward: stock's fused ``TELayerNormColumnParallelLinear`` norms this rank's shard
``[s/tp, b, h]`` and casts the norm's **fp32** result straight to FP8 with the linear's input
quantizer (one rounding: TE ``module/layernorm_linear.py:233-253``, its fused norm kernel),
then all-gathers the FP8 bits (``distributed.py:982-1073``): half the bytes of a bf16 gather.
Domino gathers that input itself, ahead of the call and behind another chunk's work
(:mod:`megatron_domino.communication.sequence_parallel`), on the layer with its norms apart
(:mod:`megatron_domino.specs.te_spec`), so it casts the same way: :func:`fp8_input_quantizer` finds
the quantizer TE's call would use, :func:`quantized_norm_output` calls the TE norm module once
on the shard with that quantizer as its output quantizer (the fp32 result cast once, as the
fused module does; the FP8 output carries the gradient, no bf16 norm output is made), and
:func:`quantized_gather`
starts TE's own all-gather of its FP8 bits. The call then gets an FP8 tensor ``[s, b/p, h]``,
which TE uses as it is (``linear.py:384-386``), and saves as it is (the ``"inp"`` alias,
``linear.py:606-616``): :mod:`megatron_domino.communication.saved_shards` keeps this rank's FP8 shard of it
instead (and nothing of the bf16 one) and gathers it again in backward, as stock keeps its
FP8 shard (``linear.py:565-569``, ``928-955``).

Backward: stock's ``TERowParallelLinear`` casts its output gradient's shard to FP8 with its
grad-output quantizer and all-gathers the FP8 bits (``module/base.py:1636, 1653-1684``).
Domino gathers that gradient itself (the reduce-scatter's backward twin), so it casts it with
the same quantizer first (:func:`fp8_grad_output_quantizer`) and hands TE's backward the
gathered FP8 gradient, which TE uses as it is: the same bytes as stock in both directions.

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
import warnings
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron_domino.base.config import DominoUnsupportedError

__all__ = [
    "casts_reduce_amax",
    "fp8_grad_output_quantizer",
    "fp8_input_quantizer",
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


def fp8_input_quantizer(module: torch.nn.Module):
    """The FP8 input quantizer ``module``'s next call will use, or ``None`` (not a TE module, or
    no FP8 autocast open).

    ``init_fp8_metadata`` is what the call's ``prepare_forward`` runs first (TE
    ``module/base.py:1552``): it reads the open ``fp8_autocast`` into ``module.fp8`` and builds
    the quantizers for its recipe (a no-op when they exist for that recipe); the input
    quantizer is the first of ``_get_quantizers`` (``module/linear.py:2007-2037``), the one the
    call quantizes its input with. Asked while the module still has its own settings
    (``parallel_mode="column"``, ``sequence_parallel=True``), so TE leaves the quantizer as its
    stock all-gather leaves it.
    """
    if not hasattr(module, "init_fp8_metadata"):  # TE's base module has it, Megatron's linears not
        return None
    module.init_fp8_metadata()
    if not module.fp8:
        return None
    quantizer = module._get_quantizers(False, False, torch.is_grad_enabled())[0]
    return _in_role(module, quantizer, "scaling_fwd", "GEMM1_INPUT", "input")


def _in_role(module: torch.nn.Module, quantizer, scaling: str, role: str, what: str):
    """``quantizer``, checked to be the one in ``module``'s slot of ``role`` (TE's
    ``FP8FwdTensorIdx``/``FP8BwdTensorIdx`` names): Domino reads ``_get_quantizers``' tuple by
    position, which a TE outside the tested range may reorder (the quantizers exist only from
    a module's first FP8 call, so this runs at each call, not when Domino is applied).

    Raises:
        DominoUnsupportedError: another quantizer sits at that position.
    """
    from transformer_engine.pytorch.constants import FP8BwdTensorIdx, FP8FwdTensorIdx

    names = FP8FwdTensorIdx if scaling == "scaling_fwd" else FP8BwdTensorIdx
    if quantizer is not module.quantizers[scaling][getattr(names, role)]:
        raise DominoUnsupportedError(
            f"Domino reads the {what} quantizer of {type(module).__name__} by its position in "
            f"Transformer Engine's _get_quantizers, and this TE keeps another quantizer there "
            f"(not {scaling}[{role}]): its FP8 casts would use the wrong scales. Use a "
            "Transformer Engine in the tested range (megatron_domino.base.version."
            "TESTED_TRANSFORMER_ENGINE), or train without --domino."
        )
    return quantizer


def fp8_grad_output_quantizer(module: torch.nn.Module):
    """The FP8 quantizer the backward of TE row linear ``module``'s last call casts its output
    gradient with, or ``None`` (not a TE module, or that call was not in FP8): the last of
    ``_get_quantizers`` (``module/linear.py:2024-2028``), asked with the module's own settings
    (``parallel_mode="row"``, ``sequence_parallel=True``) as stock's call asks it."""
    if not getattr(module, "fp8", False) or not hasattr(module, "_get_quantizers"):
        return None
    quantizer = module._get_quantizers(False, False, True)[5]
    return _in_role(module, quantizer, "scaling_bwd", "GRAD_OUTPUT1", "output-gradient")


@contextlib.contextmanager
def _gathered_cast(quantizer, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Inside, ``quantizer`` casts a shard that is then gathered, as TE's own SP gathers set it
    up (its settings restored after): tensors autograd can carry (``internal`` off), row-wise
    only where TE's all-gather takes row-wise bits only (per-tensor scaling: the transpose is
    made after the gather) and both buffers otherwise (block scaling: 1 x 128 tiles along the
    tokens cannot be made from the row-wise bits, so TE gathers both), and for a current-scaling
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
    quantizer.set_usage(rowwise=True, columnwise=not quantizer.supports_only_rowwise_all_gather())
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
    with torch.no_grad(), _gathered_cast(quantizer, _amax_group(quantizer, amax_group)):
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
        with _gathered_cast(quantizer, _amax_group(quantizer, amax_group)):
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


def quantized_gather(quantized: torch.Tensor, quantizer, group: dist.ProcessGroup):
    """Start the all-gather of the FP8 shard ``quantized`` ``[s/tp, b/p, h]`` with TE's own
    function: ``(output [s, b/p, h] Float8Tensor, to read after the handle's wait, [handle])``.

    TE's FP8 block all-gather (``--fp8-recipe blockwise``) needs the tokens of the shard
    (``s/tp x b/p``, the rows of its 1 x 128 tiles' scale layout) to be a multiple of 128;
    otherwise TE gathers the tensor in bf16, synchronously, and returns no handle: the gather
    cannot overlap anything. That is said once per process
    (:class:`SynchronousGatherWarning`), naming the shape rule."""
    global gather_along_first_dim, _warned_synchronous
    if gather_along_first_dim is None:
        gather_along_first_dim = _te_gather_along_first_dim()
    with _gathered_cast(quantizer):
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
