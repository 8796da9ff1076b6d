"""The oracle arm: every tensor-parallel collective becomes a no-op.

``T_oracle`` is the time of the same model, data and compute with no tensor-parallel
communication at all: wrong numbers, right time. It is the upper bound Domino's iteration
time can approach. Megatron-Core and Domino look ``torch.distributed.<collective>`` up at
call time, except Megatron-Core's gather/scatter functions bound at import, which are
replaced where they are bound; calls on other groups (data parallel, barriers) run unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from megatron_domino.runtime.tp_collectives import (
    swapped_tp_collectives,
)


class _CompletedWork:
    """Stands in for the handle of an ``async_op=True`` collective that was skipped."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _skipping(original, tp_group: dist.ProcessGroup, zero_output: bool):
    """``original`` that returns at once, moving no data, when called on ``tp_group``.

    With ``zero_output`` the output buffer (the first argument of a gather or scatter) is
    zeroed: it is uninitialised memory, whose denormals or NaNs would slow the CPU arithmetic
    that reads it.
    """

    def collective(*args, group=None, async_op=False, **kwargs):
        if group is not tp_group:
            return original(*args, group=group, async_op=async_op, **kwargs)
        if zero_output:
            args[0].zero_()
        return _CompletedWork() if async_op else None

    return collective


@contextlib.contextmanager
def tp_collectives_skipped(tp_group: dist.ProcessGroup) -> Iterator[None]:
    """Within the block, collectives on ``tp_group`` return at once and move no data."""
    with swapped_tp_collectives(
        lambda name, original: _skipping(original, tp_group, zero_output=name != "all_reduce")
    ):
        yield
