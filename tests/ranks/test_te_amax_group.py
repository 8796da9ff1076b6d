"""Under ``--fp8-recipe tensorwise`` with sequence parallelism, the amax reductions of Domino's
chunked FP8 casts run on a communicator of their own, never behind Domino's collectives in
flight on the TP group (:mod:`megatron_domino.runtime.amax_group`).

Each chunk's norm output (forward) and row-output gradient (backward) is cast to FP8 before its
gather, and the cast's amax is reduced over the TP ranks first (TE's current scaling: a
blocking all-reduce, ``amax_reduction_group->allreduce(...)->wait()``; on the CPU backend
``tests/te_cpu/fp8.py``). On NCCL a collective runs after every collective issued before it on
the same communicator, so on the TP group that reduction would wait for the other chunks'
gathers and reduce-scatters Domino has in flight: the overlap serialised. The NCCL-hazard
harness (``tests/nccl_hazards.py``) lists such a blocking call (its FIFO rule). On TE's own
layers (TE's Python, CPU backend), TP = 2, ``sp-p4`` (at ``p = 2`` the SP schedule has no
other chunk's collective in flight when a cast runs; with more chunks it has), bf16 with FP8
tensorwise:

* Domino: nothing serialised, nothing unwaited or written in flight; every amax reduction of
  the step ran on ``runtime.amax_group``, none on the TP group;
* the control, the reductions put back on the TP group (the code before): serialised calls
  listed, at the amax reduction of the CPU backend's cast.
"""

from __future__ import annotations

import pytest
from multiproc import run_on_ranks
from te_models import te_options, te_spec

from lab.analysis.equivalence import forward_backward, token_batch
from lab.models.gpt_model import build_gpt_model
from megatron_domino.apply import apply_domino
from megatron_domino.base.config import DominoConfig

pytestmark = pytest.mark.te


def _tensorwise_step(amax_on_tp_group: bool) -> dict:
    """One stock and one Domino forward and backward under the hazard harness: what the harness
    listed, and the amax reductions (the CPU backend's cast's MAX all-reduces) per group during
    Domino's step."""
    import sys

    import torch.distributed as dist
    from nccl_hazards import NcclHazards

    options = te_options(True, bf16=True, fp8_format="hybrid", fp8_recipe="tensorwise")
    model = build_gpt_model(options, spec=te_spec(True))
    batch = token_batch(options, 4)
    counted, groups = {"amax": 0, "tp": 0, "other": 0}, {}
    original = dist.all_reduce

    def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        frame, from_cast = sys._getframe(1), False
        while frame is not None and not from_cast:
            from_cast, frame = "te_cpu" in frame.f_code.co_filename, frame.f_back
        if op == dist.ReduceOp.MAX and groups and from_cast:
            which = next((name for name, g in groups.items() if g is group), "other")
            counted[which] += 1
        return original(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = counting
    hazards = NcclHazards()
    try:
        with hazards.installed():
            forward_backward(model, batch)
            stock = hazards.end_step("stock")
            with apply_domino(model, DominoConfig(chunks=4)) as handle:
                runtime = handle.runtime
                if amax_on_tp_group:
                    runtime.amax_group = runtime.tp_group
                groups.update(tp=runtime.tp_group, amax=runtime.amax_group)
                forward_backward(model, batch)
                groups.clear()
            domino = hazards.end_step("domino")
    finally:
        dist.all_reduce = original
    return dict(
        stock_serialised=stock.serialised,
        serialised=domino.serialised,
        unwaited=domino.unwaited,
        violations=domino.violations,
        reductions=counted,
        separate=runtime.amax_group is not runtime.tp_group,
    )


def test_amax_reductions_run_on_their_own_group_and_nothing_is_serialised():
    found = run_on_ranks(_tensorwise_step, 2, args=(False,), te=True)[0]
    assert found["separate"]
    assert not found["serialised"] and not found["stock_serialised"], found
    assert not found["unwaited"] and not found["violations"], found
    assert found["reductions"]["amax"] > 0 and found["reductions"]["tp"] == 0, found


def test_on_the_tp_group_they_queue_behind_dominos_collectives():
    """The control: what the code before this change did (the cast's reduction on the TP group)."""
    found = run_on_ranks(_tensorwise_step, 2, args=(True,), te=True)[0]
    assert found["reductions"]["tp"] > 0
    assert found["serialised"], found
    assert all(
        "te_cpu/fp8.py" in entry and "all_reduce behind" in entry for entry in found["serialised"]
    )
