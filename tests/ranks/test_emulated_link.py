"""The benchmark's emulated interconnect: exact numerics, the async contract, modelled time.

One launch of two gloo ranks runs every check: each collective kind against gloo's own result
(fp32 and bf16, SUM/MAX), outputs untouched until ``wait()``, completion no earlier than the
modelled wire time with collectives serialised on one wire in launch order, a wait that
sleeps rather than spins, the wait for a late peer counted apart from the wire, the refusal of unwaited launches, and Megatron-Core's row-parallel
linear routed through it. Timing checks are lower bounds on the model (a sleep never returns
early), never speed claims.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
import torch.distributed as dist
from multiproc import run_on_ranks

from lab.bench.emulated_link import MAX_IN_FLIGHT, LinkModel

#: 80 Mbit/s: a 1 MB tensor spends 0.1 s on the wire, far above sleep and poll granularity.
SLOW = LinkModel.from_mbit(80.0, latency_s=1e-3)


def _tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def _numerics(link, group) -> list[str]:
    """Each kind on the emulated link against the same call on gloo; the mismatches."""
    rank = dist.get_rank(group)
    generator = torch.Generator().manual_seed(17 + rank)
    failures = []
    for dtype in (torch.float32, torch.bfloat16):
        data = torch.randn(6, 3, 8, generator=generator).to(dtype)
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
            expected, got = data.clone(), data.clone()
            dist.all_reduce(expected, op=op, group=group)
            link.all_reduce(got, op=op)
            if not torch.equal(expected, got):
                failures.append(f"all_reduce {op} {dtype}")
        expected, got = data.new_empty(12, 3, 8), data.new_empty(12, 3, 8)
        dist.all_gather_into_tensor(expected, data, group=group)
        link.all_gather_into_tensor(got, data)
        if not torch.equal(expected, got):
            failures.append(f"all_gather {dtype}")
        expected, got = data.new_empty(3, 3, 8), data.new_empty(3, 3, 8)
        dist.reduce_scatter_tensor(expected, data, group=group)
        link.reduce_scatter_tensor(got, data)
        if not torch.equal(expected, got):
            failures.append(f"reduce_scatter {dtype}")
    return failures


def _async_contract(link) -> dict:
    """Launch two 1 MB all-reduces back to back, wait them in reverse order."""
    world = dist.get_world_size(link.group)
    rank = dist.get_rank(link.group)
    first = torch.full((262144,), float(rank + 1))
    second = torch.full((262144,), 10.0 * (rank + 1))
    before = first.clone()
    dist.barrier(group=link.group)
    start = time.monotonic()
    handles = [link.all_reduce(t, async_op=True) for t in (first, second)]
    untouched = torch.equal(first, before)
    cpu = time.process_time()
    handles[1].wait()
    second_done = time.monotonic() - start
    waited_cpu = time.process_time() - cpu
    handles[0].wait()
    wire = SLOW.wire_seconds("all_reduce", first.numel() * 4, world)
    return {
        "untouched_before_wait": untouched,
        "sums": (float(first[0]), float(second[0])),
        "expected_sums": (sum(range(1, world + 1)), 10.0 * sum(range(1, world + 1))),
        "second_done_s": second_done,
        "two_wire_s": 2 * wire,
        "wait_cpu_s": waited_cpu,
    }


def _late_peer(link) -> tuple[float, float]:
    """Rank 1 launches 0.15 s late: rank 0's (peer wait, blocked) seconds for it."""
    dist.barrier(group=link.group)
    before = link.stats.peer_wait_s.get("late", 0.0), link.stats.blocked_s.get("late", 0.0)
    link.phase = "late"
    if dist.get_rank(link.group) == 1:
        time.sleep(0.15)
    link.all_reduce(torch.ones(4))
    link.phase = ""
    return (
        link.stats.peer_wait_s["late"] - before[0],
        link.stats.blocked_s["late"] - before[1],
    )


def _unwaited(link) -> str:
    handles = [link.all_reduce(torch.ones(4), async_op=True) for _ in range(MAX_IN_FLIGHT)]
    try:
        link.all_reduce(torch.ones(4), async_op=True)
    except RuntimeError as error:
        message = str(error)
    else:
        message = ""
    for handle in handles:
        handle.wait()
    return message


def _megatron_row_linear(link, group) -> dict:
    """A row-parallel linear's forward and input gradient, on gloo then routed through the
    link: whether they are equal, and how many collectives the link served."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    from lab.bench.emulated_link import tp_collectives_emulated
    from lab.models.gpt_model import GPTOptions, transformer_config

    world = dist.get_world_size(group)
    options = GPTOptions(
        num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=4, vocab_size=16
    )
    config = transformer_config(options, tensor_model_parallel_size=world)
    linear = RowParallelLinear(
        32,
        16,
        config=config,
        init_method=config.init_method,
        bias=False,
        input_is_parallel=True,
        skip_bias_add=True,
    )
    x = torch.randn(4, 2, 32 // world, generator=torch.Generator().manual_seed(3))
    results, served = [], link.stats.collectives
    for context in (contextlib.nullcontext, lambda: tp_collectives_emulated(link)):
        with context():
            inp = x.clone().requires_grad_()
            out, _ = linear(inp)
            out.square().sum().backward()
            results.append((out.detach(), inp.grad))
    return {
        "equal": all(torch.equal(a, b) for a, b in zip(results[0], results[1], strict=True)),
        "served": link.stats.collectives - served,
    }


def _emulated_link_checks() -> dict:
    from lab.bench.emulated_link import EmulatedLink

    group = _tp_group()
    link = EmulatedLink(group, SLOW, capacity_bytes=4 << 20)
    return {
        "numerics": _numerics(link, group),
        "async": _async_contract(link),
        "late_peer": _late_peer(link),
        "unwaited": _unwaited(link),
        "megatron": _megatron_row_linear(link, group),
        "stats": link.stats.as_dict(),
    }


def test_emulated_link_numerics_contract_and_modelled_time():
    results = run_on_ranks(_emulated_link_checks, 2)
    for result in results:
        assert result["numerics"] == []
        contract = result["async"]
        assert contract["untouched_before_wait"]
        assert contract["sums"] == contract["expected_sums"]
        # One wire, launch order: the second waits behind the first even when waited first.
        assert contract["second_done_s"] >= contract["two_wire_s"]
        # The wait sleeps: its CPU time is a small part of the 0.2 s it blocked.
        assert contract["wait_cpu_s"] < 0.1 * contract["second_done_s"]
        assert "never waited on this rank" in result["unwaited"]
        # Waiting for a late peer is counted apart from the wire (1 ms latency + 4 bytes).
        assert results[0]["late_peer"][0] > 0.1 and results[0]["late_peer"][1] < 0.05
        # The row linear's forward all-reduce went through the link, with gloo's result.
        assert result["megatron"] == {"equal": True, "served": 1}
        stats = result["stats"]
        assert stats["by_kind"]["all_gather"] == 2 and stats["by_kind"]["reduce_scatter"] == 2
        assert stats["wire_s"] > contract["two_wire_s"]


def test_link_model_rejects_a_link_with_no_bandwidth():
    with pytest.raises(ValueError, match="positive bandwidth"):
        LinkModel(0.0)
    ring = LinkModel(1e9, latency_s=0.0)
    assert ring.wire_seconds("all_reduce", 10**6, 2) == pytest.approx(1e-3)
    assert ring.wire_seconds("all_gather", 10**6, 4) == pytest.approx(3e-3)
    assert ring.wire_seconds("reduce_scatter", 10**6, 4) == pytest.approx(0.75e-3)
