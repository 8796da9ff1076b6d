"""A second process group over the tensor-parallel ranks, for the FP8 amax reductions of
Domino's chunked casts.

Under ``--fp8-recipe tensorwise`` (current scaling) with sequence parallelism, each chunk's
norm output and row-output gradient is cast to FP8 before its all-gather, and the cast first
reduces its amax over the TP ranks, as stock's gathered casts do (TE
``set_quantizer_amax_reduction_group``; the cast runs ``allreduce(...)->wait()``, blocking).
On NCCL a collective starts only after every collective issued before it on the same
communicator: on the TP group, a chunk's amax reduction would wait for the gathers and
reduce-scatters of other chunks that Domino keeps in flight there, and the compute stream with
it, which serialises the overlap. On a communicator of its own over the same ranks the
reduction (a few bytes) runs at once; its value, the maximum over the same ranks, is the same.

One group per set of ranks, made the first time a model needs it and kept for the process
(like Megatron-Core's own groups in ``parallel_state``): a new NCCL communicator costs its
set-up and memory, and every re-application of Domino (``--domino-chunks auto`` switches
settings between iterations) and every model chunk (virtual pipeline stages) on those ranks
uses the same. Only the group's own ranks take part in making it
(``use_local_synchronization``), so each TP group makes its own at apply time, whatever the
other TP groups do.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["amax_reduction_group"]

_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def amax_reduction_group(tp_group: dist.ProcessGroup) -> dist.ProcessGroup:
    """The process group over ``tp_group``'s ranks for amax reductions (module docstring)."""
    ranks = tuple(dist.get_process_group_ranks(tp_group))
    group = _GROUPS.get(ranks)
    if group is None:
        group = _GROUPS[ranks] = dist.new_group(ranks=list(ranks), use_local_synchronization=True)
    return group
