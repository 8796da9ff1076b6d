"""Which collectives this torch's gloo backend runs on device tensors, and what to do if not.

Two ranks on one GPU cannot use NCCL, so the GPU check runs tensor parallelism over gloo
with CUDA tensors. Gloo's CUDA support differs by collective and release, so before any
model runs, :func:`probe_collectives` tries each collective Domino and Megatron-Core use
(``all_reduce`` with SUM and MAX, ``all_gather_into_tensor``, ``reduce_scatter_tensor``) in
fp32 and bf16, blocking and with ``async_op=True``, and checks the numbers. A collective
counts as supported only if every combination ran and gave the right result on every rank.

Everything here runs in an initialised default process group (world size >= 2); the ranks
agree on each outcome through a CPU all-reduce, which gloo always supports.
:func:`staging_plan` turns the outcomes into what the model parts do about a missing
collective (stage it through host memory, or skip what needs it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from lab.models.gpu_check_models import NEEDS

__all__ = [
    "COLLECTIVES",
    "Collectives",
    "ProbeOutcome",
    "describe",
    "probe_collectives",
    "staging_plan",
    "supported",
]

#: The collectives Domino and Megatron-Core's TP layers call, in probe order.
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
DTYPES = ("float32", "bfloat16")
_N = 4  # elements per rank


@dataclass(frozen=True)
class ProbeOutcome:
    """One collective in one dtype and mode; ``error`` is ``None`` when it worked everywhere."""

    collective: str
    dtype: str
    async_op: bool
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None


def _expected(collective: str, rank: int, world: int) -> torch.Tensor:
    base = torch.arange(world * _N, dtype=torch.float32)
    if collective == "all_reduce":
        return sum(base + r for r in range(world))
    if collective == "all_gather_into_tensor":
        return torch.cat([torch.full((_N,), float(r + 1)) for r in range(world)])
    return sum(base + r for r in range(world))[rank * _N : (rank + 1) * _N]


def _run(collective: str, device: str, dtype: torch.dtype, async_op: bool) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    base = torch.arange(world * _N, dtype=dtype, device=device) + rank
    if collective == "all_reduce":
        # Megatron-Core's vocab-parallel cross-entropy also all-reduces with MAX.
        peak = torch.full((_N,), float(rank + 1), dtype=dtype, device=device)
        work = dist.all_reduce(peak, op=dist.ReduceOp.MAX, async_op=async_op)
        if async_op:
            work.wait()
        if not torch.equal(peak.float().cpu(), torch.full((_N,), float(world))):
            raise ValueError(f"all_reduce(MAX) gave {peak.tolist()} on rank {rank}")
        output = base
        work = dist.all_reduce(output, async_op=async_op)
    elif collective == "all_gather_into_tensor":
        output = torch.empty(world * _N, dtype=dtype, device=device)
        shard = torch.full((_N,), float(rank + 1), dtype=dtype, device=device)
        work = dist.all_gather_into_tensor(output, shard, async_op=async_op)
    else:
        output = torch.empty(_N, dtype=dtype, device=device)
        work = dist.reduce_scatter_tensor(output, base, async_op=async_op)
    if async_op:
        work.wait()
    return output


def _try_one(collective: str, device: str, dtype_name: str, async_op: bool) -> str | None:
    """This rank's error for one combination, or ``None``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        output = _run(collective, device, getattr(torch, dtype_name), async_op)
        if output.device.type != torch.device(device).type:
            return f"result came back on {output.device}"
        expected = _expected(collective, rank, world)
        if not torch.equal(output.float().cpu(), expected):
            return f"wrong result on rank {rank}: {output.tolist()} != {expected.tolist()}"
        return None
    except Exception as error:  # noqa: BLE001 - any failure means "unsupported"
        lines = str(error).strip().splitlines() or [""]
        return f"{type(error).__name__}: {lines[0][:200]}"


def probe_collectives(device: str) -> list[ProbeOutcome]:
    """Try every collective, dtype and mode on ``device`` tensors; all ranks get the same list."""
    outcomes = []
    for collective in COLLECTIVES:
        for dtype_name in DTYPES:
            for async_op in (False, True):
                error = _try_one(collective, device, dtype_name, async_op)
                failed = torch.tensor([0 if error is None else 1])
                dist.all_reduce(failed, op=dist.ReduceOp.MAX)
                if error is None and failed.item():
                    error = "failed on another rank"
                outcomes.append(ProbeOutcome(collective, dtype_name, async_op, error))
    return outcomes


def probe_rank(device: str) -> list[ProbeOutcome]:
    """Entry point for :func:`~lab.launch.ranks.run_ranks` (``init="plain"``)."""
    if device == "cuda":
        torch.cuda.set_device(0)
    return probe_collectives(device)


def supported(outcomes: list[ProbeOutcome]) -> dict[str, bool]:
    """Per collective: whether every dtype and mode worked."""
    return {c: all(o.ok for o in outcomes if o.collective == c) for c in COLLECTIVES}


def describe(outcomes: list[ProbeOutcome]) -> list[str]:
    """One line per collective: ``all_reduce: works (fp32, bf16; blocking, async)`` or the
    combinations that failed, each with its error."""
    lines = []
    for collective, ok in supported(outcomes).items():
        if ok:
            lines.append(f"{collective}: works (float32, bfloat16; blocking, async_op=True)")
            continue
        failed = [
            f"{o.dtype} {'async' if o.async_op else 'blocking'}: {o.error}"
            for o in outcomes
            if o.collective == collective and not o.ok
        ]
        lines.append(f"{collective}: UNSUPPORTED ({'; '.join(failed)})")
    return lines


@dataclass(frozen=True)
class Collectives:
    """What the probe found, and what the model parts do about it.

    Attributes:
        supported: per collective, whether gloo ran it on the device (``None``: unknown,
            the probe itself failed).
        staged: collectives the ranks stage through host memory (the test-only shim).
        policy: ``--host-staging`` (``auto``, ``never`` or ``always``).
    """

    supported: dict[str, bool | None]
    staged: tuple[str, ...]
    policy: str

    def missing_for(self, sequence_parallel: bool) -> list[str]:
        """Collectives a model needs that neither gloo nor the shim provides."""
        return [
            c
            for c in NEEDS[sequence_parallel]
            if not self.supported.get(c) and c not in self.staged
        ]

    def staging_note(self) -> list[str]:
        if not self.staged:
            return []
        return [
            "collectives staged through host memory by the TEST-ONLY shim "
            f"(gpu_check/host_staging.py): {', '.join(self.staged)}. Each rank job first "
            "checks the shim's results with the probe; stock and Domino both go through it, so "
            "the comparison is like for like, but times measured under it include synchronous "
            "host copies."
        ]


def staging_plan(supported: dict[str, bool | None], policy: str) -> Collectives:
    """Decide what to stage: ``auto`` stages what the probe did not confirm, ``always``
    everything, ``never`` nothing (cases needing a missing collective are then skipped)."""
    if policy == "always":
        staged = COLLECTIVES
    elif policy == "auto":
        staged = tuple(c for c in COLLECTIVES if not supported.get(c))
    else:
        staged = ()
    return Collectives(supported=dict(supported), staged=tuple(staged), policy=policy)
