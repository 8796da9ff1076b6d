"""Part 4: Domino's in-flight collectives under NCCL's stream semantics, on one process.

Two ranks on one GPU cannot use NCCL, so parts 1 and 2 run gloo; this part is the one
NCCL-semantics check a single GPU allows: world size 1, Domino's in-flight classes on an NCCL
group (a gloo group with ``--device cpu``). On NCCL a collective runs on its own stream: it
must wait for the kernel that produced its input, keep the input's memory alive after the
caller dropped it (the caching allocator must not hand that block to the next allocation
while NCCL still reads it), and make the compute stream wait at ``wait()``. Each case:

1. produce the input with a queue of kernels on the compute stream (so NCCL's read is late);
2. launch through Domino's class; drop every Python reference to the input (and to the
   temporary ``contiguous()`` copies Domino makes);
3. allocate tensors of the same size on the compute stream and fill them with NaN (they take
   freed blocks first);
4. wait, and compare the result with the expected one (world size 1: the input itself).

Cases: :class:`~megatron_domino.communication.collectives.ForwardAllReduce` (the
:class:`~megatron_domino.communication.collectives.InFlight` base's launch, record, wait),
:class:`~megatron_domino.communication.collectives.SequenceCollective`'s all-gather and reduce-scatter of
non-contiguous inputs, and
:class:`~megatron_domino.communication.saved_shards.SavedInputRegather`: a column linear's call keeping only
its shards, re-gathered in backward; its gradients must equal those of the same call without
it. On the CPU the same code runs on gloo, where nothing is asynchronous in this sense: it
checks the code, not NCCL.
"""

from __future__ import annotations

import time

from lab.gpu_check import markdown
from lab.gpu_check.results import Part, PartResult

__all__ = ["CASES", "inflight_rank", "run_part"]

PART = Part(
    "inflight",
    "4. in-flight collectives (NCCL, world size 1)",
    "lab.gpu_check.check_inflight:inflight_rank",
    failure_summary="the process failed;",
    world_size=1,
    init="plain",
)
CASES = (
    "InFlight: forward all-reduce",
    "SequenceCollective: all-gather",
    "SequenceCollective: reduce-scatter",
    "SavedInputRegather: backward re-gather",
)
_GRADIENT_TOLERANCE = 1e-5
_SEQ, _BATCH, _HIDDEN = 512, 2, 1024  # [s, b, h] on the GPU; the CPU uses 1/8 of s and h


def _busy(x, rounds: int = 64):
    """``x`` after a queue of kernels on the current stream that leave it unchanged."""
    import torch

    square = x.reshape(-1, x.shape[-1])[: x.shape[-1]]
    for _ in range(rounds):
        torch.mm(square, square.t())
    return x * 1.0


def _poison_like(template, copies: int = 4) -> list:
    """Fresh tensors of ``template``'s size filled with NaN on the compute stream."""
    import torch

    return [torch.full_like(template, float("nan")) for _ in range(copies)]


def _error(result, expected) -> float:
    import torch

    if not bool(torch.isfinite(result).all()):
        return float("inf")
    return float((result.float() - expected.float()).abs().max())


def _forward_all_reduce(group, label, source):
    from megatron_domino.communication.collectives import ForwardAllReduce

    partial = _busy(source)
    expected = partial.clone()
    slot = ForwardAllReduce(group, label)
    out = slot.launch(partial)
    del partial
    _poison_like(expected)
    slot.finish()
    return _error(out, expected), slot.pending


def _sequence(group, label, source, kind: str):
    from megatron_domino.communication.collectives import SequenceCollective

    # A transposed view: Domino's contiguous() copy is the only tensor NCCL reads.
    strided = _busy(source).transpose(0, 1)
    expected = strided.contiguous().clone()
    slot = SequenceCollective(group, label)
    getattr(slot, kind)(strided, "fwd")
    del strided
    _poison_like(expected)
    result = slot.wait()
    return _error(result, expected), slot.pending


def _regather(group, label, source):
    import torch
    import torch.nn.functional as F

    from megatron_domino.communication.saved_shards import SavedInputRegather

    class ColumnCall(torch.nn.Module):
        """Saves ``x`` itself (a view of the gathered input) and two tensors of its size."""

        def __init__(self):
            super().__init__()
            h = source.shape[-1]
            self.weight = torch.nn.Parameter(torch.randn(h // 2, h, device=source.device) * 0.02)

        def forward(self, x):
            return F.linear(x * torch.sigmoid(x), self.weight)

    module = ColumnCall()
    grad = torch.randn(*source.shape[:-1], module.weight.shape[0], device=source.device)
    reference = source.clone().requires_grad_(True)
    module(reference).backward(grad)
    shard = _busy(source)
    gathered = shard.clone().requires_grad_(True)  # world size 1: the gather is a copy
    regather = SavedInputRegather(group, label, shard)
    with regather.keeping_shards(gathered, module):
        out = module(gathered)
    del shard
    regather.launch()
    _poison_like(source)
    out.backward(grad)
    return _error(gathered.grad, reference.grad), regather.pending


def inflight_rank(device: str) -> list[dict]:
    """Entry point for :func:`~lab.launch.ranks.run_ranks` (``init="plain"``,
    world size 1): every :data:`CASES` entry, ``{case, error, left_pending, launches,
    passed}``."""
    import torch
    import torch.distributed as dist

    from megatron_domino.base.recorder import LAUNCH, WAIT_END, CollectiveLabel, EventRecorder

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    group = dist.new_group([0], backend="nccl" if cuda else "gloo")
    scale = 1 if cuda else 8
    generator = torch.Generator().manual_seed(0)
    shape = (_SEQ // scale, _BATCH, _HIDDEN // scale)
    source = torch.randn(*shape, generator=generator).to(device)
    runs = {
        CASES[0]: lambda label: _forward_all_reduce(group, label, source),
        CASES[1]: lambda label: _sequence(group, label, source, "all_gather"),
        CASES[2]: lambda label: _sequence(group, label, source, "reduce_scatter"),
        CASES[3]: lambda label: _regather(group, label, source),
    }
    rows = []
    for case, run in runs.items():
        recorder = EventRecorder(use_cuda_events=False)
        error, pending = run(CollectiveLabel("inflight_check", 0, 0, recorder))
        kinds = [event.kind for event in recorder.events()]
        if cuda:
            torch.cuda.synchronize()
        # Collectives move bits: exact. The re-gather's gradients are the same kernels on the
        # same values as the reference's, up to the GEMM's reduction order.
        tolerance = _GRADIENT_TOLERANCE if case == CASES[3] else 0.0
        # One launch and one wait recorded: the case ran through Domino's class.
        ran = kinds.count(LAUNCH) == 1 and kinds.count(WAIT_END) == 1
        rows.append(
            dict(
                case=case,
                error=error,
                left_pending=pending,
                launches=kinds.count(LAUNCH),
                passed=ran and error <= tolerance,
            )
        )
    dist.destroy_process_group(group)
    return rows


def _table(rows: list[dict]) -> str:
    return markdown.table(
        ("case", "launches", "max abs error", "left in flight", "result"),
        (
            (r["case"], r["launches"], f"{r['error']:.3g}", r["left_pending"],
             "passed" if r["passed"] else "FAILED")
            for r in rows
        ),
    )  # fmt: skip


def run_part(device: str, quick: bool, budget_s: float) -> PartResult:
    """The part, as the check's parent runs it (one spawned process within ``budget_s``)."""
    del quick  # one size: the check is about ordering, and takes seconds either way
    from lab.gpu_check.parts import run_part_ranks

    start = time.monotonic()
    backend = "NCCL" if device == "cuda" else "gloo (CPU stand-in: no NCCL semantics)"
    per_rank, failed_part = run_part_ranks(PART, budget_s=budget_s, device=device, args=(device,))
    if failed_part is not None:
        return failed_part
    (rows,) = per_rank
    failed = [r["case"] for r in rows if not r["passed"] or r["left_pending"]]
    return PART.judged(
        failed,
        f"{len(rows) - len(failed)} of {len(rows)} cases passed on {backend}",
        budget_s,
        start=start,
        notes=[] if device == "cuda" else [f"ran on {backend}."],
        details={"backend": backend, "cases": rows},
        table=_table(rows),
    )
