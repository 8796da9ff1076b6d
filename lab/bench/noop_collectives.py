"""The oracle arm: every tensor-parallel collective becomes a no-op.

``T_oracle`` is the time of the same model, data and compute with no tensor-parallel
communication at all: wrong numbers, right time. It is the upper bound Domino's iteration
time can approach. Megatron-Core and Domino look ``torch.distributed.<collective>`` up at
call time, except Megatron-Core's gather/scatter functions bound at import, which are
replaced where they are bound; calls on other groups (data parallel, barriers) run unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch.distributed as dist
from megatron.core.tensor_parallel import layers as tp_layers
from megatron.core.tensor_parallel import mappings as tp_mappings

from megatron_domino.runtime.patch import Patch

#: (module, attribute) of every collective Megatron-Core's tensor parallelism and Domino call.
#: ``layers.py`` and ``mappings.py`` bind the gather/scatter functions at import, so the
#: ``torch.distributed`` attributes alone would not reach them.
TP_COLLECTIVES = (
    (dist, "all_reduce"),
    (dist, "all_gather_into_tensor"),
    (dist, "reduce_scatter_tensor"),
    (tp_layers, "dist_all_gather_func"),
    (tp_layers, "dist_reduce_scatter_func"),
    (tp_mappings, "dist_all_gather_func"),
    (tp_mappings, "dist_reduce_scatter_func"),
)
#: What each attribute of :data:`TP_COLLECTIVES` does; the gather/scatter functions
#: Megatron-Core binds at import are ``all_gather_into_tensor`` / ``reduce_scatter_tensor``
#: under another name.
COLLECTIVE_KINDS = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "dist_all_gather_func": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "dist_reduce_scatter_func": "reduce_scatter",
}


@contextlib.contextmanager
def swapped_tp_collectives(replace: Callable[[str, Callable], Callable]) -> Iterator[None]:
    """Within the block, each attribute ``name`` of :data:`TP_COLLECTIVES` is
    ``replace(name, original)``; the originals come back on exit, also when the block raises.

    The one place the bench's arms (no-op, logged, emulated link) and the tests swap the TP
    collectives; ``replace`` gets the attribute's name (its kind: :data:`COLLECTIVE_KINDS`)
    and the function it replaces, which a wrapper calls for what it does not handle.
    """
    with contextlib.ExitStack() as stack:
        for owner, name in TP_COLLECTIVES:
            replacement = replace(name, getattr(owner, name))
            stack.enter_context(Patch(owner, name, replacement, "swap a TP collective").applied())
        yield


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
