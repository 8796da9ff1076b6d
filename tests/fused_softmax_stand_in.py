"""CPU stand-ins for the CUDA extensions behind Megatron-Core's fused softmax, and a recorder.

Megatron-Core's ``FusedScaleMaskSoftmax`` (``megatron/core/fusions/fused_softmax.py``) decides
in Python which softmax runs: with ``masked_softmax_fusion`` (Megatron-LM's default) and
fp16/bf16 scores ``[b, np, sq, sk]``, ``is_kernel_available`` checks the shapes and asks the
extension ``scaled_masked_softmax_cuda.get_batch_per_block``; if it allows, a causal softmax
runs ``scaled_upper_triang_masked_softmax_cuda`` (after asserting ``sq == sk``) and any other
mask type ``scaled_masked_softmax_cuda`` with the mask; otherwise the torch softmax runs. The
extensions are CUDA-only, so on the CPU the fused path cannot be exercised as is.
:func:`installed` puts plain-torch modules of the same names into ``sys.modules`` for a
``with`` block, so Megatron's whole decision and its autograd functions run unchanged on the
CPU and choose what they would choose on a GPU, and records every softmax call in
:data:`CALLS` (the torch fallback too).

What the stand-ins keep of the real kernels (Megatron-LM / Apex ``csrc/megatron``, read, not
copied):

* ``get_batch_per_block(sq, sk, b, np)``: rows per 128-thread block: warps of
  ``min(32, next_pow2(sk))`` lanes, two rows per warp up to 128 keys, else one;
* upper-triangular: input ``[attn_batches, sq, sk]`` read as a square ``sq x sq`` matrix; key
  ``j > i`` masked (probability 0). The stand-in refuses ``sq != sk``, where the real kernel
  would silently read the wrong elements (Megatron's own assert is gone under ``python -O``);
* masked: input ``[b, np, sq, sk]``, mask ``[1 or b, 1, sq, sk]`` read as a dense byte array
  (the stand-in refuses a non-contiguous one); masked scores set to ``-10000`` after scaling;
* both: softmax in fp32, output in the input's dtype (fp16/bf16 only); backward
  ``scale * y * (g - sum(g * y))``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import types
from collections.abc import Iterator

import torch
from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax


@dataclasses.dataclass(frozen=True)
class SoftmaxCall:
    """One softmax: which implementation (``upper_triang``, ``masked``, ``torch``), the
    query and key lengths, and the mask it applied (``None``: none passed)."""

    kernel: str
    sq: int
    sk: int
    mask: torch.Tensor | None


#: Every softmax run inside :func:`installed`, in order.
CALLS: list[SoftmaxCall] = []


def _check_half(inputs: torch.Tensor) -> None:
    if inputs.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError("the fused softmax kernels take fp16 or bf16 only")


def _backward(output_grads: torch.Tensor, probs: torch.Tensor, scale) -> torch.Tensor:
    grads, y = output_grads.float(), probs.float()
    return (scale * y * (grads - (grads * y).sum(-1, keepdim=True))).to(output_grads.dtype)


def _upper_triang_forward(inputs: torch.Tensor, scale) -> torch.Tensor:
    _check_half(inputs)
    _, sq, sk = inputs.shape
    CALLS.append(SoftmaxCall("upper_triang", sq, sk, None))
    if sq != sk:
        raise AssertionError(
            f"the upper-triangular softmax kernel reads a square matrix; got [{sq}, {sk}]"
        )
    masked = torch.ones(sq, sk, dtype=torch.bool, device=inputs.device).triu(diagonal=1)
    scores = (inputs.float() * scale).masked_fill(masked, float("-inf"))
    return torch.softmax(scores, dim=-1).to(inputs.dtype)


def _masked_forward(inputs: torch.Tensor, mask: torch.Tensor, scale) -> torch.Tensor:
    _check_half(inputs)
    b, _, sq, sk = inputs.shape
    CALLS.append(SoftmaxCall("masked", sq, sk, mask.detach().clone()))
    if mask.dim() != 4 or mask.shape[1:] != (1, sq, sk) or mask.shape[0] not in (1, b):
        raise AssertionError(f"mask {tuple(mask.shape)} does not fit scores {tuple(inputs.shape)}")
    if not mask.is_contiguous():
        raise AssertionError("the masked softmax kernel reads the mask as a dense array")
    scores = (inputs.float() * scale).masked_fill(mask, -10000.0)
    return torch.softmax(scores, dim=-1).to(inputs.dtype)


def _scaled_forward(inputs: torch.Tensor, scale) -> torch.Tensor:
    _check_half(inputs)
    CALLS.append(SoftmaxCall("scaled", inputs.shape[-2], inputs.shape[-1], None))
    return torch.softmax(inputs.float() * scale, dim=-1).to(inputs.dtype)


def _batch_per_block(sq: int, sk: int, b: int, np: int) -> int:
    next_power_of_two = 1 << math.ceil(math.log2(sk))
    lanes = min(next_power_of_two, 32)
    return 128 // lanes * (2 if next_power_of_two <= 128 else 1)


def _extensions() -> dict[str, types.ModuleType]:
    found = {}
    for name, functions in (
        ("scaled_upper_triang_masked_softmax_cuda", dict(forward=_upper_triang_forward)),
        (
            "scaled_masked_softmax_cuda",
            dict(forward=_masked_forward, get_batch_per_block=_batch_per_block),
        ),
        ("scaled_softmax_cuda", dict(forward=_scaled_forward)),
    ):
        module = types.ModuleType(name, "CPU stand-in (tests/fused_softmax_stand_in.py)")
        for attribute, function in {**functions, "backward": _backward}.items():
            setattr(module, attribute, function)
        found[name] = module
    return found


@contextlib.contextmanager
def installed() -> Iterator[list[SoftmaxCall]]:
    """The stand-in extensions importable, and every softmax recorded in :data:`CALLS`."""
    extensions = _extensions()
    saved = {name: sys.modules.get(name) for name in extensions}
    torch_softmax = FusedScaleMaskSoftmax.forward_torch_softmax

    def recorded_torch_softmax(self, input, mask, softmax_offset=None):
        kept = None if mask is None else mask.detach().clone()
        CALLS.append(SoftmaxCall("torch", input.shape[2], input.shape[3], kept))
        return torch_softmax(self, input, mask, softmax_offset)

    sys.modules.update(extensions)
    FusedScaleMaskSoftmax.forward_torch_softmax = recorded_torch_softmax
    try:
        yield CALLS
    finally:
        FusedScaleMaskSoftmax.forward_torch_softmax = torch_softmax
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        CALLS.clear()
