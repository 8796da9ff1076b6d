"""Answers to Transformer Engine's CUDA questions, given to TE's own modules only.

TE's Python asks CUDA a handful of questions before it computes anything (TE 2.18:
``module/base.py:863`` ``torch.cuda.is_available()``, ``module/base.py:1539`` ``inp.is_cuda``,
``quantization.py:584`` stream capture, ``cpp_extensions/gemm.py:37`` and ``utils.py`` device
properties and capability, ``distributed.py:947`` / ``quantized_tensor.py:520``
``torch.cuda.current_device()``, ``utils.py:53`` ``Tensor.cuda()`` inside a backward, where
no torch function mode runs). Each answer here is the one an H100 (sm_90, 132 SMs) gives, and
it is given only when the caller is a module of ``transformer_engine``: torch, Megatron-Core,
Domino and the tests keep seeing a machine without CUDA, as they do without TE.

The caller is found from the calling frame's module name, one frame above the patched
function or property. Allocations TE places on ``"cuda"`` outside a
backward go to the CPU through the CPU runtime's device mode, as Megatron's do.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import SimpleNamespace

import torch

__all__ = ["H100", "answer_te_cuda_questions"]

#: What TE reads of the device: capability 9.0 (Hopper), its SM count and memory.
H100 = SimpleNamespace(
    name="NVIDIA H100 80GB HBM3 (TE's CPU backend)",
    major=9,
    minor=0,
    multi_processor_count=132,
    total_memory=80 * 2**30,
)


def _asked_by_te(depth: int) -> bool:
    caller = sys._getframe(depth + 1).f_globals.get("__name__", "")
    return caller == "transformer_engine" or caller.startswith("transformer_engine.")


def _for_te(original: Callable, te_answer: Callable) -> Callable:
    """``original`` for every caller but TE's modules, which get ``te_answer``."""

    def answer(*args, **kwargs):
        if _asked_by_te(1):
            return te_answer(*args, **kwargs)
        return original(*args, **kwargs)

    answer.__wrapped__ = original
    answer.__doc__ = original.__doc__
    return answer


_TORCH_CUDA_ANSWERS = {
    "is_available": lambda: True,
    "current_device": lambda: 0,
    "device_count": lambda: 1,
    "get_device_properties": lambda device=None: H100,
    "get_device_capability": lambda device=None: (H100.major, H100.minor),
    "is_current_stream_capturing": lambda: False,
    "synchronize": lambda device=None: None,
}


def answer_te_cuda_questions() -> None:
    """Install the answers (once per process, before TE is imported; never undone: the
    process is a TE test rank or its fork server)."""
    for name, te_answer in _TORCH_CUDA_ANSWERS.items():
        setattr(torch.cuda, name, _for_te(getattr(torch.cuda, name), te_answer))
    torch.Tensor.cuda = _for_te(torch.Tensor.cuda, lambda self, *args, **kwargs: self)
    is_cuda = torch._C.TensorBase.is_cuda

    def _is_cuda(self) -> bool:
        return True if _asked_by_te(1) else is_cuda.__get__(self)

    torch.Tensor.is_cuda = property(_is_cuda, doc=is_cuda.__doc__)
