"""The oracle arm: every tensor-parallel collective becomes a no-op.

``T_oracle`` is the time of the same model, data and compute with no tensor-parallel
communication at all: wrong numbers, right time. It is the upper bound Domino's iteration
time can approach. Megatron-Core and Domino both look ``torch.distributed.<collective>`` up
at call time, so replacing those attributes for the duration of an arm reaches every
collective; calls on other groups (data parallel, barriers) run unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

#: The collectives Megatron-Core's tensor parallelism and Domino issue.
TP_COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


class _CompletedWork:
    """Stands in for the handle of an ``async_op=True`` collective that was skipped."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@contextlib.contextmanager
def tp_collectives_skipped(tp_group: dist.ProcessGroup) -> Iterator[None]:
    """Within the block, collectives on ``tp_group`` return at once and move no data."""
    originals = {name: getattr(dist, name) for name in TP_COLLECTIVES}

    def skipping(name):
        original = originals[name]

        def collective(*args, group=None, async_op=False, **kwargs):
            if group is tp_group:
                if name != "all_reduce":
                    # The output buffer of a gather/scatter is uninitialised memory, whose
                    # denormals or NaNs would slow the CPU arithmetic that reads it.
                    args[0].zero_()
                return _CompletedWork() if async_op else None
            return original(*args, group=group, async_op=async_op, **kwargs)

        return collective

    for name in TP_COLLECTIVES:
        setattr(dist, name, skipping(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
