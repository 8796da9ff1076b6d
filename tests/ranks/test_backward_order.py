"""Domino's own backward order (legs, :mod:`megatron_domino.engine.legs`) on TP = 2 ranks.

* **The recorded order.** One forward and backward per setting on a 3-layer model, recorded
  by the event recorder; the middle layer is the steady state. Without sequence parallelism
  every input-gradient all-reduce flies while each other chunk runs its column linear's dgrad
  GEMM (another chunk's core backward, the cover autograd's order does not give at p = 2 or
  p = 4: the same check on ``--domino-backward-order autograd`` finds violations, and on the
  negative control ``serial`` every all-reduce has nothing between launch and wait). Under
  sequence parallelism the column linear's input-gradient reduce-scatter flies behind its own
  dW GEMM and another chunk's GEMMs, the gather of each row linear's output gradient behind
  another chunk's GEMMs (``serial`` again fails it).
* **Megatron DDP with ``overlap_grad_reduce`` and the distributed optimizer**, two steps of two
  micro-batches, fp32, also under sequence parallelism with gradient-accumulation fusion:
  losses, every ``main_grad`` after ``finalize_model_grads`` and the weights after Adam equal
  stock's to fp32 rounding; each layer weight's DDP hook runs once per
  chunk's leg (``p`` per micro-batch; once under autograd's order), and each bucket's
  reduction starts once, after its last weight's last leg, inside the backward. A control with
  one gradient 1 % off fails the same comparison.
* **An exception inside a leg** leaves no collective in flight, and the group keeps working.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from ddp_training import differences, train_ddp
from multiproc import run_on_ranks
from tiny_models import TINY

from lab.analysis.equivalence import token_batch
from lab.models.gpt_model import GPTOptions, build_gpt_model
from megatron_domino.apply import apply_domino
from megatron_domino.base.config import DominoConfig
from megatron_domino.base.recorder import BEGIN, LAUNCH, WAIT_BEGIN, EventRecorder
from megatron_domino.base.settings import setting

LAYERS, MIDDLE = 3, 1
OPTIONS = GPTOptions(num_layers=LAYERS, **TINY, num_attention_heads=4)
#: The settings recorded; ``sp-`` ones on the sequence-parallel model.
ORDERS = (
    "p2", "p4", "s2", "p2-autograd-order", "p4-autograd-order", "s2-autograd-order",
    "p2-serial-order", "p4-serial-order",
    "sp-p2", "sp-p4", "sp-p2-serial-order",
)  # fmt: skip


def _record_orders() -> dict:
    """On every rank: per setting, the backward's events as plain tuples
    ``(kind, name, layer, chunk, collective)``."""
    models = {
        sp: build_gpt_model(dataclasses.replace(OPTIONS, sequence_parallel=sp))
        for sp in (False, True)
    }
    batch = token_batch(OPTIONS, 4)
    recorded = {}
    for name in ORDERS:
        chosen = setting(name)
        recorder = EventRecorder()
        with apply_domino(models[chosen.sequence_parallel], chosen.config, recorder=recorder):
            loss = models[chosen.sequence_parallel](**batch).mean()
            recorder.clear()
            loss.backward()
        recorded[name] = [
            (e.kind, e.name, e.layer, e.chunk, e.collective) for e in recorder.events()
        ]
    return recorded


@pytest.fixture(scope="module")
def orders() -> dict:
    return run_on_ranks(_record_orders, 2)[0]


def _flights(events: list[tuple]) -> list[tuple[str, int, int, list[tuple]]]:
    """Per backward collective of the middle layer: ``(name, layer, chunk, regions)``, the
    compute regions that began between its launch and its wait."""
    flights = []
    for index, (kind, name, layer, chunk, collective) in enumerate(events):
        if kind != LAUNCH or layer != MIDDLE:
            continue
        wait = next(
            i for i in range(index, len(events))
            if events[i][0] == WAIT_BEGIN and events[i][4] == collective
        )  # fmt: skip
        regions = [e[1:4] for e in events[index:wait] if e[0] == BEGIN]
        flights.append((name, layer, chunk, regions))
    return flights


def _uncovered_all_reduces(events: list[tuple], p: int) -> list[tuple]:
    """The middle layer's input-gradient all-reduces during which not every other chunk ran
    its column linear's dgrad GEMM (the core backward); each with the chunks that did."""
    found = []
    for name, layer, chunk, regions in _flights(events):
        if name.endswith("_dgrad_ar"):
            cores = {c for region, _, c in regions if region == "dgrad_gemm" and c != chunk}
            if len(cores) < p - 1:
                found.append((name, layer, chunk, sorted(cores)))
    return found


@pytest.mark.parametrize("name", ["p2", "p4", "s2"])
def test_each_input_gradient_all_reduce_flies_behind_every_other_chunks_core(orders, name):
    p = setting(name).config.chunks
    flights = [f for f in _flights(orders[name]) if f[0].endswith("_dgrad_ar")]
    assert len(flights) == 2 * p  # QKV and fc1, every chunk
    assert not _uncovered_all_reduces(orders[name], p)


@pytest.mark.parametrize("name", ["p2", "p4", "s2"])
def test_autograds_order_and_the_serial_control_fail_that_check(orders, name):
    """Autograd's order (the code before legs) covers some all-reduces with another chunk's
    projection only; the serial control covers none."""
    p = setting(name).config.chunks
    assert _uncovered_all_reduces(orders[f"{name}-autograd-order"], p)
    if f"{name}-serial-order" in orders:
        serial = _uncovered_all_reduces(orders[f"{name}-serial-order"], p)
        assert len(serial) == 2 * p and all(cores == [] for *_, cores in serial)


def _sequence_parallel_problems(events: list[tuple]) -> list[tuple]:
    """Middle-layer backward collectives under sequence parallelism that fly behind no other
    chunk's GEMM, and input-gradient reduce-scatters (``*_ag``'s twin) whose own dW GEMM did
    not run while they flew."""
    found = []
    for name, layer, chunk, regions in _flights(events):
        others = {c for region, _, c in regions if region.endswith("gemm") and c != chunk}
        own_dw = any(region == "wgrad_gemm" and c == chunk for region, _, c in regions)
        if not others or (name.endswith("_ag") and not own_dw):
            found.append((name, layer, chunk, [r for r in regions if r[0].endswith("gemm")]))
    return found


@pytest.mark.parametrize("name", ["sp-p2", "sp-p4"])
def test_under_sequence_parallelism_each_backward_collective_flies_behind_gemms(orders, name):
    flights = _flights(orders[name])
    assert {f[0] for f in flights} == {
        f"{sublayer}_{kind}"
        for sublayer in ("attention", "mlp")
        for kind in ("ag", "rs", "regather")
    }
    assert not _sequence_parallel_problems(orders[name])


def test_under_sequence_parallelism_the_serial_control_fails_it(orders):
    assert len(_sequence_parallel_problems(orders["sp-p2-serial-order"])) >= 4


# --- Megatron DDP: overlap_grad_reduce, the distributed optimizer, micro-batches, steps ------

CHUNKS = 2


def _ddp_training(config: DominoConfig | None, sequence_parallel: bool = False) -> dict:
    """Two Adam steps (distributed optimizer) of two micro-batches each, DDP overlapping the
    gradient reduction; per step the losses, the main_grads after finalize_model_grads and the
    DDP log of the last micro-batch's backward; the weights at the end. With
    ``sequence_parallel`` also gradient-accumulation fusion (Megatron's fused weight-gradient
    GEMM, its CPU stand-in)."""
    from fused_wgrad_stand_in import installed

    options = dataclasses.replace(
        OPTIONS,
        num_layers=2,
        sequence_parallel=sequence_parallel,
        gradient_accumulation_fusion=sequence_parallel,
    )
    fusion = installed() if sequence_parallel else contextlib.nullcontext()
    with fusion:
        return train_ddp(options, config)


def _ddp_arms() -> dict:
    return {
        "stock": _ddp_training(None),
        "legs": _ddp_training(DominoConfig(chunks=CHUNKS)),
        "autograd-order": _ddp_training(DominoConfig(chunks=CHUNKS, backward_order="autograd")),
        "sp-stock": _ddp_training(None, sequence_parallel=True),
        "sp-legs": _ddp_training(DominoConfig(chunks=CHUNKS), sequence_parallel=True),
    }


@pytest.fixture(scope="module")
def ddp_arms() -> dict:
    return run_on_ranks(_ddp_arms, 2, timeout_s=300)[0]


def test_ddp_overlap_and_distributed_optimizer_train_as_stock(ddp_arms):
    for arm, stock in (("legs", "stock"), ("autograd-order", "stock"), ("sp-legs", "sp-stock")):
        assert not differences(ddp_arms[arm], ddp_arms[stock]), arm
    assert ddp_arms["stock"]["steps"][1]["losses"] != ddp_arms["stock"]["steps"][0]["losses"]


def test_a_gradient_one_percent_off_fails_that_comparison(ddp_arms):
    broken = {
        "steps": [dict(step, grads=dict(step["grads"])) for step in ddp_arms["legs"]["steps"]],
        "weights": ddp_arms["legs"]["weights"],
    }
    name = next(n for n in broken["steps"][1]["grads"] if n.endswith("linear_fc1.weight"))
    broken["steps"][1]["grads"][name] = broken["steps"][1]["grads"][name] * 1.01
    assert [d.split(":")[0] for d in differences(broken, ddp_arms["stock"])] == [f"step 1 {name}"]


def _ready_counts(log: list) -> dict[str, int]:
    counts: dict[str, int] = {}
    for kind, name in log:
        if kind == "ready":
            counts[name] = counts.get(name, 0) + 1
    return counts


@pytest.mark.parametrize(
    "arm, per_layer_weight", [("legs", CHUNKS), ("autograd-order", 1), ("sp-legs", CHUNKS)]
)
def test_ddp_hooks_run_once_per_leg_and_each_bucket_reduces_once_after_its_last(
    ddp_arms, arm, per_layer_weight
):
    """In the second step (Megatron DDP learned each weight's count in the first) the last
    micro-batch's backward starts every bucket's reduction itself, once, after the bucket's
    weights' last hook."""
    log = ddp_arms[arm]["steps"][1]["log"]
    counts = _ready_counts(log)
    # Layer 0's input norm runs before the first cut, outside the legs (once per micro-batch).
    in_legs = {n: c for n, c in counts.items() if ".layers." in n and "0.input_layernorm" not in n}
    assert in_legs and set(in_legs.values()) == {per_layer_weight}, in_legs
    assert set(counts.values()) <= {1, per_layer_weight}, counts
    done = log.index(("backward done", None))
    syncs = [i for i, entry in enumerate(log) if entry[0] == "sync"]
    buckets = ddp_arms[arm]["steps"][1]["buckets"]
    assert buckets > 1 and len(syncs) == buckets and all(i < done for i in syncs)
    assert sorted(log[i][1] for i in syncs) == list(range(buckets))


# --- an exception inside a leg ------------------------------------------------------------


def _raise_inside_a_leg() -> dict:
    """A weight-gradient GEMM that raises on its third call (a leg of the backward, after
    input-gradient all-reduces were launched): what was in flight when it raised, what is
    left after, and whether the group still all-reduces."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_domino.engine import backward_overlap

    model = build_gpt_model(OPTIONS)
    seen = {"in_flight": None}
    original = backward_overlap.weight_gradient
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            seen["in_flight"] = len(handle.runtime.last_step.pending_backward)
            raise RuntimeError("injected failure inside a leg")
        return original(*args, **kwargs)

    backward_overlap.weight_gradient = failing
    try:
        with apply_domino(model, DominoConfig(chunks=CHUNKS)) as handle:
            loss = model(**token_batch(OPTIONS, 4)).mean()
            with pytest.raises(RuntimeError, match="injected failure"):
                loss.backward()
            left = len(handle.runtime.last_step.pending_backward)
    finally:
        backward_overlap.weight_gradient = original
    probe = torch.ones(3)
    dist.all_reduce(probe, group=parallel_state.get_tensor_model_parallel_group())
    return dict(in_flight=seen["in_flight"], left=left, probe=probe.tolist())


def test_an_exception_inside_a_leg_drains_what_the_step_launched():
    found = run_on_ranks(_raise_inside_a_leg, 2)[0]
    assert found["in_flight"] >= 1  # something was in flight when the leg raised
    assert found["left"] == 0
    assert found["probe"] == [2.0, 2.0, 2.0]
