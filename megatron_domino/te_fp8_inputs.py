"""Under FP8, a Transformer Engine column linear's gathered input in FP8, as stock TE gathers it.

Stock ``TEColumnParallelLinear`` under sequence parallelism casts this rank's norm output
``[s/tp, b, h]`` to FP8 with its input quantizer, row-wise only, and all-gathers the FP8 bits
(TE ``module/linear.py:342-372``, ``distributed.py:982-1073``): half the bytes of a bf16
gather. Domino gathers that input itself, ahead of the call and behind another chunk's work
(:mod:`megatron_domino.sequence_parallel`), so it casts the same way first:
:func:`fp8_input_quantizer` finds the quantizer TE's call would use, :func:`quantized_gather`
casts the shard and starts TE's own all-gather of its FP8 bits. The call then gets an FP8
tensor ``[s, b/p, h]``, which TE uses as it is (``linear.py:384-386``), and saves as it is
(the ``"inp"`` alias, ``linear.py:606-616``): :mod:`megatron_domino.saved_shards` keeps this
rank's FP8 shard of it instead and gathers it again in backward, as stock keeps its FP8 shard
(``linear.py:565-569``, ``928-955``).

Two of the quantizer's settings change for the cast and the gather, and are restored after:
``internal`` off, so the cast makes a ``Float8Tensor`` (a tensor subclass autograd can carry
into the linear's call) instead of a ``Float8TensorStorage``; usage row-wise only, as TE's own
all-gather needs it. The scale is the delayed-scaling scale the call itself would use: it is
the same on every rank and every chunk of the micro-batch (Domino refuses the recipes that
compute scales from each call's data, :func:`megatron_domino.refusals.te_problems`).

What has run where: modelled on the CPU by the TE stand-ins (``tests/te_fp8_stand_in.py``),
not run on Transformer Engine (no GPU with TE was available).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

__all__ = ["fp8_input_quantizer", "quantize_shard", "quantized_gather"]


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
    return module._get_quantizers(False, False, torch.is_grad_enabled())[0]


@contextlib.contextmanager
def _rowwise_tensors(quantizer) -> Iterator[None]:
    """``quantizer`` makes row-wise ``Float8Tensor`` s inside; its settings are restored after."""
    internal, rowwise, columnwise = (
        quantizer.internal,
        quantizer.rowwise_usage,
        quantizer.columnwise_usage,
    )
    quantizer.internal = False
    quantizer.set_usage(rowwise=True, columnwise=False)
    try:
        yield
    finally:
        quantizer.internal = internal
        quantizer.set_usage(rowwise=rowwise, columnwise=columnwise)


def quantize_shard(quantizer, shard: torch.Tensor) -> torch.Tensor:
    """``shard`` ``[s/tp, b/p, h]`` cast to FP8 row-wise, as a ``Float8Tensor`` (no autograd:
    the gradient reaches ``shard`` through Domino's gather nodes)."""
    with torch.no_grad(), _rowwise_tensors(quantizer):
        return quantizer(shard)


def _te_gather_along_first_dim():
    """TE's FP8-aware all-gather (``transformer_engine.pytorch.distributed``)."""
    from transformer_engine.pytorch.distributed import gather_along_first_dim

    return gather_along_first_dim


#: TE's ``gather_along_first_dim``, imported on first use (TE needs CUDA); the CPU tests put
#: their stand-in of it here.
gather_along_first_dim = None


def quantized_gather(quantized: torch.Tensor, quantizer, group: dist.ProcessGroup):
    """Start the all-gather of the FP8 shard ``quantized`` ``[s/tp, b/p, h]`` with TE's own
    function: ``(output [s, b/p, h] Float8Tensor, to read after the handle's wait, [handle])``."""
    global gather_along_first_dim
    if gather_along_first_dim is None:
        gather_along_first_dim = _te_gather_along_first_dim()
    with _rowwise_tensors(quantizer):
        output, handle = gather_along_first_dim(
            quantized, group, async_op=True, quantizer=quantizer
        )
    return output, [handle] if handle is not None else []
