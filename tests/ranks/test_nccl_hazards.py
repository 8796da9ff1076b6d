"""Domino keeps NCCL's async contract: checked on gloo with ``tests/nccl_hazards.py``.

Every async collective's output is NaN until its ``wait()``, its inputs are compared at the
wait with their values at launch, and a handle never waited is listed at the end of each step
(one forward and backward). Three launches:

* the wrapper itself, on two plain gloo ranks: a read before the wait sees NaN, a written
  input and a written in-place buffer are violations, a forgotten handle is listed;
* TP = 2: every setting of :data:`MATRIX` on a plain model, the sequence-parallel ones
  on an SP model, some under full and selective recompute, each against stock Megatron-Core
  (which runs under the wrapper too: its own async all-reduces and gathers must keep the
  contract). Then a Domino broken on purpose (a wait of each kind skipped, an in-flight input
  written) must fail;
* TP = 2 x PP = 2: Megatron-Core's 1F1B schedule over three micro-batches, where one
  micro-batch's backward collectives are in flight across another's forward.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from multiproc import run_on_ranks
from nccl_hazards import NcclHazards
from test_domino_pipeline import MICRO_BATCH as PP_MICRO_BATCH
from test_domino_pipeline import MICRO_BATCHES, _train_step
from tiny_models import LLAMA_STYLE

from lab.analysis.equivalence import forward_backward, mismatches, token_batch
from lab.analysis.errors import TOLERANCES
from lab.launch.ranks import run_ranks
from lab.models.gpt_model import GPTOptions, build_gpt_model
from megatron_domino.apply import apply_domino
from megatron_domino.base.settings import setting
from megatron_domino.communication import collectives

TOLERANCE = TOLERANCES[torch.float32]
MODEL = GPTOptions(num_layers=2, **LLAMA_STYLE)
#: model variant -> its GPTOptions and the setting names run on it.
MATRIX = {
    "plain": (
        MODEL,
        (
            "p2",
            "p4",
            "p1-k2",
            "p2-k2",
            "p2-intra-layer",
            "p2-no-backward-overlap",
            "s2",
            "s2-k2",
        ),
    ),
    "sequence-parallel": (
        dataclasses.replace(MODEL, sequence_parallel=True),
        ("sp-p2", "sp-p4", "sp-p1-k2", "sp-p2-k2", "sp-p2-intra-layer", "sp-s2"),
    ),
    "full-recompute": (
        dataclasses.replace(
            MODEL, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        ),
        ("p2", "p4", "s2"),
    ),
    "full-recompute-sp": (
        dataclasses.replace(
            MODEL,
            sequence_parallel=True,
            recompute_granularity="full",
            recompute_method="uniform",
            recompute_num_layers=1,
        ),
        ("sp-p2",),
    ),
    "selective-recompute": (
        dataclasses.replace(MODEL, recompute_granularity="selective"),
        ("p2", "p2-k2"),
    ),
}
PIPELINE_SETTINGS = ("p2-k2", "sp-p2")


def _micro_batch(name: str) -> int:
    """4 (p = 4 needs it); 1 for the sequence split under SP (micro-batch 1 only)."""
    named = setting(name)
    return 1 if named.sequence_parallel and named.config.split_along == "sequence" else 4


# -- the wrapper itself ---------------------------------------------------------------------


def _contract() -> dict:
    """On two plain gloo ranks: each hazard, made on purpose, and what the wrapper says."""
    hazards = NcclHazards()
    rank = dist.get_rank()
    found = {}
    original = dist.all_reduce
    with hazards.installed():
        found["installed"] = dist.all_reduce is not original
        tensor = torch.full((4,), float(rank + 1))
        work = dist.all_reduce(tensor, async_op=True)
        found["read_early_nan"] = bool(tensor.isnan().all())
        work.wait()
        found["after_wait"] = tensor.tolist()
        found["clean"] = hazards.end_step("clean")

        shard = torch.full((2,), float(rank))
        output = torch.empty(4)
        work = dist.all_gather_into_tensor(output, shard, async_op=True)
        shard.add_(1)  # written while NCCL may still read it
        work.wait()
        found["written_input"] = hazards.end_step("written input")

        full = torch.ones(4)
        output = torch.empty(2)
        work = dist.reduce_scatter_tensor(output, full, async_op=True)
        full.data[0] = 7.0  # behind autograd's back: the values, not the version, show it
        work.wait()
        found["changed_input"] = hazards.end_step("changed input")

        tensor = torch.ones(3)
        work = dist.all_reduce(tensor, async_op=True)
        tensor.data.zero_()  # the in-place buffer written in flight
        work.wait()
        found["written_buffer"] = hazards.end_step("written buffer")

        dist.all_reduce(torch.ones(2), async_op=True)  # never waited
        found["unwaited"] = hazards.end_step("unwaited")

        synchronous = torch.ones(2)
        dist.all_reduce(synchronous)
        found["synchronous"] = (synchronous.tolist(), hazards.end_step("synchronous"))

        # One queue per communicator: a blocking all-reduce behind an async one on the same
        # group is serialised; on another group over the same ranks it is not.
        in_flight = torch.ones(2)
        work = dist.all_reduce(in_flight, async_op=True)
        dist.all_reduce(torch.ones(1))
        behind_default = hazards.end_step("behind")
        work.wait()
        other = dist.new_group(ranks=[0, 1])
        work = dist.all_reduce(in_flight, async_op=True)
        dist.all_reduce(torch.ones(1), group=other)
        work.wait()
        found["fifo"] = (behind_default, hazards.end_step("another group"))
    found["restored"] = dist.all_reduce is original
    return found


def test_the_wrapper_makes_each_hazard_show():
    found = run_ranks(f"{__name__}:_contract", 2, device="cpu", init="plain", timeout_s=120)[0]
    assert found["read_early_nan"] and found["after_wait"] == [3.0] * 4
    assert found["clean"].clean and found["clean"].launches == {"tests": 1}
    for case, problem in [
        ("written_input", "input_tensor was modified in place while in flight"),
        ("changed_input", "input input changed while in flight"),
        ("written_buffer", "in-place buffer tensor was written while in flight"),
    ]:
        (violation,) = found[case].violations
        assert violation.endswith(problem) and "test_nccl_hazards.py" in violation, violation
    (unwaited,) = found["unwaited"].unwaited
    assert unwaited.endswith("in _contract: all_reduce"), unwaited
    values, synchronous = found["synchronous"]
    assert values == [2.0, 2.0] and synchronous.clean and not synchronous.launches
    behind, elsewhere = found["fifo"]
    (serialised,) = behind.serialised
    assert serialised.endswith("in _contract: all_reduce behind 1 in flight"), serialised
    assert not elsewhere.serialised
    assert found["installed"] and found["restored"]


# -- every setting, TP = 2 ------------------------------------------------------------------


def _row(hazards: NcclHazards, label: str, result, reference) -> dict:
    step = hazards.end_step(label)
    loss_finite = bool(torch.isfinite(result.loss).all())
    return dict(
        launches=dict(step.launches),
        unwaited=step.unwaited,
        violations=step.violations,
        serialised=step.serialised,
        mismatches=mismatches(result, reference, TOLERANCE)[:3],
        loss_finite=loss_finite,
    )


def _run_matrix(hazards: NcclHazards, found: dict) -> None:
    for variant, (options, names) in MATRIX.items():
        model = build_gpt_model(options)
        batches = {}
        for name in names:
            size = _micro_batch(name)
            if size not in batches:
                batch = token_batch(options, size)
                reference = forward_backward(model, batch, finalize_sequence_parallel=True)
                found[(variant, f"stock-b{size}")] = _row(hazards, "stock", reference, reference)
                batches[size] = (batch, reference)
            batch, reference = batches[size]
            with apply_domino(model, setting(name).config):
                result = forward_backward(model, batch, finalize_sequence_parallel=True)
            found[(variant, name)] = _row(hazards, name, result, reference)


def _skip_wait(kind: type):
    """``InFlight.finish`` that, for ``kind``, forgets its handles instead of waiting."""
    finish = collectives.InFlight.finish

    def broken(self):
        if isinstance(self, kind):
            self._works = []
        else:
            finish(self)

    return broken


def _run_broken(hazards: NcclHazards, found: dict) -> None:
    """Domino p2 with one defect at a time: every one must fail the check."""
    forward, sequence = collectives.ForwardAllReduce, collectives.SequenceCollective
    defects = {
        "skipped forward all-reduce wait": ("plain", "p2", "finish", _skip_wait(forward)),
        "skipped sequence-parallel wait": (
            "sequence-parallel",
            "sp-p2",
            "finish",
            _skip_wait(sequence),
        ),
    }
    original_scatter = sequence.reduce_scatter

    def scatter_then_write(self, full, direction):
        original_scatter(self, full, direction)
        with torch.no_grad():
            full.add_(1.0)  # the partial sum written while NCCL may still read it

    defects["input written in flight"] = (
        "sequence-parallel",
        "sp-p2",
        "reduce_scatter",
        scatter_then_write,
    )
    for defect, (variant, name, method, replacement) in defects.items():
        options, _ = MATRIX[variant]
        model = build_gpt_model(options)
        batch = token_batch(options, _micro_batch(name))
        reference = forward_backward(model, batch, finalize_sequence_parallel=True)
        hazards.end_step("stock")
        owner = collectives.InFlight if method == "finish" else sequence
        original = getattr(owner, method)
        setattr(owner, method, replacement)
        try:
            with apply_domino(model, setting(name).config):
                result = forward_backward(model, batch, finalize_sequence_parallel=True)
        finally:
            setattr(owner, method, original)
        found[("broken", defect)] = _row(hazards, defect, result, reference)


def _every_setting() -> dict:
    hazards = NcclHazards()
    found = {}
    with hazards.installed():
        _run_matrix(hazards, found)
        _run_broken(hazards, found)
    return found


@pytest.fixture(scope="module")
def tp2():
    return run_on_ranks(_every_setting, 2, timeout_s=300)[0]


def test_every_setting_keeps_the_contract(tp2):
    rows = {key: row for key, row in tp2.items() if key[0] != "broken"}
    expected = {(variant, name) for variant, (_, names) in MATRIX.items() for name in names}
    assert expected <= set(rows)
    for key, row in rows.items():
        assert not row["unwaited"] and not row["violations"], (key, row)
        assert not row["serialised"], (key, row)  # nothing blocking on a busy communicator
        assert not row["mismatches"] and row["loss_finite"], (key, row)
    for variant, name in expected:
        launches = rows[(variant, name)]["launches"]
        # Domino's own in-flight collectives went through the wrapper (every setting runs
        # some: the row all-reduces or SP's gathers, at the least).
        assert launches.get("megatron_domino", 0) >= 4, (variant, name, launches)
    counts = [rows[key]["launches"].get("megatron_domino", 0) for key in sorted(expected)]
    print(f"async launches by Domino per step: {min(counts)}..{max(counts)} over {len(counts)}")


def test_a_broken_domino_fails_it(tp2):
    broken = {key[1]: row for key, row in tp2.items() if key[0] == "broken"}
    for defect in ("skipped forward all-reduce wait", "skipped sequence-parallel wait"):
        row = broken[defect]
        assert row["unwaited"], (defect, row)
        assert all(
            "megatron_domino/communication/collectives.py" in site for site in row["unwaited"]
        ), row
        assert not row["loss_finite"] or row["mismatches"], (defect, row)
    written = broken["input written in flight"]
    assert written["violations"] and not written["unwaited"], written
    assert all(
        v.endswith("reduce_scatter_tensor: its input was modified in place while in flight")
        and "megatron_domino/communication/collectives.py" in v
        for v in written["violations"]
    ), written


# -- pipeline parallelism: 1F1B, TP = 2 x PP = 2 --------------------------------------------


def _pipelined() -> dict:
    hazards = NcclHazards()
    found = {}
    with hazards.installed():
        for name in PIPELINE_SETTINGS:
            named = setting(name)
            options = dataclasses.replace(
                MODEL, num_layers=4, sequence_parallel=named.sequence_parallel
            )
            model = build_gpt_model(options)
            batches = [token_batch(options, PP_MICRO_BATCH, seed=m) for m in range(MICRO_BATCHES)]
            reference = _train_step(model, batches, options)
            stock = hazards.end_step("stock")
            with apply_domino(model, named.config):
                result = _train_step(model, batches, options)
            step = hazards.end_step(name)
            wrong = mismatches(result, reference, TOLERANCE)[:3]
            found[name] = dict(stock=stock, domino=step, wrong=wrong)
    return found


def test_pipelined_steps_keep_the_contract():
    results = run_on_ranks(_pipelined, 4, pipeline_model_parallel_size=2, timeout_s=300)
    for rank, found in enumerate(results):
        for name, row in found.items():
            assert row["stock"].clean and row["domino"].clean, (rank, name, row)
            assert not row["wrong"], (rank, name, row)
            assert row["domino"].launches.get("megatron_domino", 0) > 0, (rank, name, row)
