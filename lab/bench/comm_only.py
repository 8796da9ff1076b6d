"""The comm-only arm: an arm's tensor-parallel collectives, same sizes and order, no compute.

The hidden fraction ``(T_base - T_dom) / (T_base - T_oracle)`` cannot tell a weak schedule
from a physical limit: where a phase's communication takes longer than its compute, no
schedule hides all of it. ``T_comm``, the time of the phase's collectives alone on the same
link, gives the bound: a perfectly overlapped phase takes ``max(T_noop, T_comm)`` (its own
no-communication time, or the wire time, whichever is longer), so the benchmark reports

    roofline efficiency = (T_base - T_dom) / (T_base - max(T_noop, T_comm))

per phase: 1 is the best any schedule of these collectives could do on this machine.

How: one step of the arm runs with every collective on the TP group logged (kind, input and
output shapes, dtype, phase) and performed as usual; :func:`replay` then issues the logged
collectives of a phase back to back, all launched asynchronously in the recorded order and
waited for at the end, on fresh buffers, with nothing computed in between. That is the
fastest the link and gloo serve this exact traffic: a lower bound on what the phase's
communication needs, so the roofline efficiency is not flattered.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_domino.runtime.tp_collectives import COLLECTIVE_KINDS, swapped_tp_collectives

__all__ = ["CollectiveCall", "CollectiveLog", "replay", "tp_collectives_logged"]


@dataclass(frozen=True)
class CollectiveCall:
    """One logged collective: ``kind`` with its output (and, for gather/scatter, input) shape.

    For ``all_reduce`` the tensor is reduced in place, so ``input_shape`` is ``None``.
    """

    kind: str
    output_shape: tuple[int, ...]
    input_shape: tuple[int, ...] | None
    dtype: torch.dtype
    phase: str


@dataclass
class CollectiveLog:
    """The collectives of one step, in call order; ``phase`` ("fwd"/"bwd") is set by the caller
    before the forward and before the backward."""

    phase: str = "fwd"
    calls: list[CollectiveCall] = field(default_factory=list)

    def of_phase(self, phase: str) -> list[CollectiveCall]:
        return [call for call in self.calls if call.phase == phase]

    def bytes_of_phase(self, phase: str) -> int:
        """Bytes each rank contributes (the all-reduced tensor, the gathered or scattered input)."""
        total = 0
        for call in self.of_phase(phase):
            shape = call.input_shape if call.input_shape is not None else call.output_shape
            total += torch.Size(shape).numel() * torch.empty((), dtype=call.dtype).element_size()
        return total


def _logging(original, kind: str, tp_group: dist.ProcessGroup, log: CollectiveLog):
    """``original``, which also appends a :class:`CollectiveCall` when called on ``tp_group``.

    The tensors are found by ``torch.distributed``'s own parameter order (the output first,
    then the input), whether passed by position or by name (DeepSpeed passes ``tensor=``).
    """
    signature = inspect.signature(original)

    def collective(*args, group=None, **kwargs):
        if group is tp_group:
            tensors = list(signature.bind(*args, **kwargs).arguments.values())
            output = tensors[0]
            source = None if kind == "all_reduce" else tuple(tensors[1].shape)
            log.calls.append(
                CollectiveCall(kind, tuple(output.shape), source, output.dtype, log.phase)
            )
        return original(*args, group=group, **kwargs)

    return collective


@contextlib.contextmanager
def tp_collectives_logged(tp_group: dist.ProcessGroup, log: CollectiveLog) -> Iterator[None]:
    """Within the block, collectives on ``tp_group`` run as usual and are logged into ``log``.

    Patches the same attributes as the oracle arm
    (:data:`~megatron_domino.runtime.tp_collectives.TP_COLLECTIVES`); each wrapper calls
    the original function object, so a call reaching ``torch.distributed`` through Megatron's
    import-time alias is logged once.
    """
    with swapped_tp_collectives(
        lambda name, original: _logging(original, COLLECTIVE_KINDS[name], tp_group, log)
    ):
        yield


def _launch(call: CollectiveCall, tp_group: dist.ProcessGroup, buffers: tuple) -> dist.Work:
    output, source = buffers
    if call.kind == "all_reduce":
        return dist.all_reduce(output, group=tp_group, async_op=True)
    if call.kind == "all_gather":
        return dist.all_gather_into_tensor(output, source, group=tp_group, async_op=True)
    return dist.reduce_scatter_tensor(output, source, group=tp_group, async_op=True)


def _buffers(call: CollectiveCall) -> tuple:
    output = torch.zeros(call.output_shape, dtype=call.dtype)
    source = None if call.input_shape is None else torch.zeros(call.input_shape, dtype=call.dtype)
    return output, source


def replay(
    calls: list[CollectiveCall], tp_group: dist.ProcessGroup, buffers: dict | None = None
) -> tuple[float, float]:
    """Seconds the slowest rank takes to perform ``calls`` with no compute (module docstring),
    and the most CPU seconds a rank's process (all its threads: gloo's included) spent on them.

    The CPU time says what the roofline leaves out: where the cores are busy computing, as on
    a CPU testbed, communication is not free of compute, and a rank's overlapped step cannot
    beat ``T_noop`` plus that CPU time. ``buffers`` (keyed by call index) keeps the zeroed tensors between replays so allocation is
    not timed; it is filled on first use. Every rank must pass the same ``calls``.
    """
    buffers = {} if buffers is None else buffers
    for index, call in enumerate(calls):
        if index not in buffers:
            buffers[index] = _buffers(call)
    dist.barrier()
    start, start_cpu = time.perf_counter(), time.process_time()
    works = [_launch(call, tp_group, buffers[i]) for i, call in enumerate(calls)]
    for work in works:
        work.wait()
    spent = [time.perf_counter() - start, time.process_time() - start_cpu]
    spent = torch.tensor(spent, dtype=torch.float64)
    dist.all_reduce(spent, op=dist.ReduceOp.MAX)
    return float(spent[0]), float(spent[1])
