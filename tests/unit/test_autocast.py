"""Domino's own GEMM autograd functions run their backward in the forward's autocast state.

Megatron-Core decorates its linear (``LinearWithGradAccumulationAndAsyncCommunication``) with
``torch.amp.custom_fwd``/``custom_bwd`` for ``device_type="cuda"``: ``backward()`` is usually
called outside the ``torch.autocast`` block, and ``custom_bwd`` re-enters the state
``custom_fwd`` recorded, so the backward GEMMs run in the same precision as the forward ones.
Domino's backward-overlap column linear and column-piece row linear must do the same.

CUDA autocast only changes ops on CUDA tensors, but its state is a thread-local flag that
``torch.autocast("cuda")`` can set on any machine once ``torch`` believes AMP is available
(patched here): the probes record that state inside each backward, on CPU tensors. fp16, as
bf16 would ask the (absent) device whether it supports bf16.
"""

from __future__ import annotations

import pytest
import torch

from megatron_domino.base.recorder import CollectiveLabel
from megatron_domino.engine import backward_overlap, column_pieces


def _autocast_state() -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")


@pytest.fixture
def cuda_amp(monkeypatch):
    """``torch.autocast("cuda")`` enabled on this machine (state only; CPU ops are unchanged)."""
    monkeypatch.setattr(torch.cuda.amp.common, "amp_definitely_not_available", lambda: False)
    return torch.autocast("cuda", dtype=torch.float16)


class _ProbeSlot:
    """A stand-in for the dgrad all-reduce slot: records the autocast state at launch."""

    label = CollectiveLabel("probe", layer=0, chunk=0)

    def __init__(self) -> None:
        self.seen = None

    def launch(self, grad_input: torch.Tensor) -> None:
        self.seen = _autocast_state()


def test_column_linear_backward_runs_in_the_forwards_autocast_state(cuda_amp):
    x = torch.randn(4, 2, 8, requires_grad=True)
    weight = torch.randn(6, 8, requires_grad=True)
    slot = _ProbeSlot()
    with cuda_amp:
        y = backward_overlap.column_linear_async_dgrad(x, weight, None, slot, False)
    y.sum().backward()
    assert slot.seen == (True, torch.float16)


def test_column_piece_backward_runs_in_the_forwards_autocast_state(cuda_amp, monkeypatch):
    seen = []

    def probe(main_grad, input_2d, grad_2d):
        seen.append(_autocast_state())
        main_grad.addmm_(grad_2d.t(), input_2d)

    monkeypatch.setattr(column_pieces, "accumulate_weight_gradient", probe)
    x = torch.randn(4, 2, 8, requires_grad=True)
    weight = torch.randn(6, 8, requires_grad=True)
    weight.main_grad = torch.zeros(6, 8)
    with cuda_amp:
        y = column_pieces.column_piece_into_main_grad(x, weight, 1, 2)
    y.sum().backward()
    assert seen == [(True, torch.float16)]
