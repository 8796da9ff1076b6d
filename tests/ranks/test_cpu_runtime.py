"""The CPU runtime: exact patch bookkeeping in this process, Megatron-Core behaviour under TP = 2.

In-process tests enter and leave the runtime and check that every patched object is restored.
Multi-process tests (gloo, TP = 2) check what the runtime exists for: Megatron's RNG streams,
an optimizer step with gradient clipping (fp32 and bf16), and a dist_checkpointing round trip.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from megatron.core.tensor_parallel import random as megatron_random
from multiproc import run_on_ranks

from lab.models.gpt_model import GPTOptions, build_gpt_model, causal_attention_mask
from megatron_domino.runtime.cpu_runtime import (
    PATCHES,
    CpuRuntime,
    CpuRuntimeError,
    cpu_runtime,
    cpu_runtime_active,
    runtime_for_device,
)

needs_no_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU runtime refuses to run next to a GPU"
)

SEED = 1234
TINY = GPTOptions(
    num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=500
)


def _snapshot() -> dict[str, object]:
    """Everything the runtime touches: patched attributes, the depth of the torch function mode
    stack (a private but stable count) and the filters on Megatron's RNG logger."""
    return {
        **{f"{patch.owner!r}.{patch.name}": vars(patch.owner)[patch.name] for patch in PATCHES},
        "torch function modes": torch._C._len_torch_function_stack(),
        "fork logger filters": list(logging.getLogger(megatron_random.__name__).filters),
    }


@needs_no_cuda
def test_exit_restores_every_patched_object():
    before = _snapshot()
    with cpu_runtime():
        assert cpu_runtime_active()
        for patch in PATCHES:
            assert vars(patch.owner)[patch.name] is patch.replacement, patch.why
        assert torch._C._len_torch_function_stack() == before["torch function modes"] + 1
    assert _snapshot() == before  # functions and classes compare by identity
    assert not cpu_runtime_active()
    with pytest.raises((AssertionError, RuntimeError)):  # CPU-only torch: no CUDA behind it
        torch.cuda.current_device()


@needs_no_cuda
def test_exit_restores_when_the_body_raises():
    before = _snapshot()
    with pytest.raises(KeyError), cpu_runtime():
        raise KeyError("boom")
    assert _snapshot() == before
    assert not cpu_runtime_active()


@needs_no_cuda
def test_entering_twice_raises_and_keeps_the_first_runtime():
    before = _snapshot()
    runtime = cpu_runtime()
    with runtime:
        patched = _snapshot()
        with pytest.raises(CpuRuntimeError, match="already active"):
            cpu_runtime().__enter__()
        with pytest.raises(CpuRuntimeError, match="already active"):
            runtime.__enter__()
        assert _snapshot() == patched
    assert _snapshot() == before


@needs_no_cuda
def test_cuda_device_arguments_land_on_the_cpu():
    with cpu_runtime():
        tensors = [
            torch.zeros(2, device="cuda"),
            torch.empty(2, device=torch.cuda.current_device()),
            torch.arange(2, device=torch.device("cuda", 0)),
            torch.ones(2).cuda(),
            torch.ones(2).to("cuda:0"),
            torch.ones(2).to(device=torch.cuda.current_device()),
            torch.ones(2).new_zeros(2, device="cuda"),
        ]
        torch.cuda.synchronize()
        # Tensor.type() is answered with CUDA names only inside the wrapped optimizer calls.
        assert torch.ones(1).type() == "torch.FloatTensor"
    assert all(tensor.device.type == "cpu" for tensor in tensors)


def test_runtime_for_device_is_a_no_op_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert isinstance(runtime_for_device(), contextlib.nullcontext)
    with pytest.raises(CpuRuntimeError, match="next to a GPU"):
        cpu_runtime().__enter__()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert isinstance(runtime_for_device(), CpuRuntime)


def _rng_draws(seed: int) -> dict[str, torch.Tensor]:
    """Draws from the default stream and from the TP stream of the tracker's fork()."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    state = torch.get_rng_state()
    undisturbed = torch.rand(4)
    torch.set_rng_state(state)
    outside = torch.rand(2)
    with get_cuda_rng_tracker().fork():
        inside = torch.rand(4)
    after = torch.rand(2)
    # Megatron's TP stream: seed + 2718 + tp_rank, untouched until this first fork.
    expected_inside = torch.rand(4, generator=torch.Generator().manual_seed(seed + 2718 + tp_rank))
    return {
        "default": torch.cat([outside, after]),
        "undisturbed": undisturbed,
        "inside": inside,
        "expected_inside": expected_inside,
    }


@needs_no_cuda
def test_rng_streams_follow_megatron_semantics_under_tp2():
    rank0, rank1 = run_on_ranks(_rng_draws, 2, args=(SEED,), seed=SEED)
    for draws in (rank0, rank1):
        # fork() swaps the stream and puts the default one back where it was.
        torch.testing.assert_close(draws["default"], draws["undisturbed"], rtol=0, atol=0)
        torch.testing.assert_close(draws["inside"], draws["expected_inside"], rtol=0, atol=0)
    # Default stream shared across TP ranks (replicated dropout), TP stream rank-specific.
    torch.testing.assert_close(rank0["default"], rank1["default"], rtol=0, atol=0)
    assert not torch.equal(rank0["inside"], rank1["inside"])


def _optimizer_step(bf16: bool, distributed_optimizer: bool, lr: float, clip_grad: float):
    """One DDP + Megatron optimizer step on TINY; returns the grad norm, the update norm over
    the whole TP group (each parameter counted once) and a replicated parameter."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    options = GPTOptions(**{**vars(TINY), "bf16": bf16})
    model = build_gpt_model(options)
    ddp = DistributedDataParallel(
        config=model.config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=bf16, use_distributed_optimizer=distributed_optimizer
        ),
        module=Float16Module(model.config, model) if bf16 else model,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam" if distributed_optimizer else "sgd",  # the former needs Adam
            lr=lr,
            weight_decay=0.0,
            clip_grad=clip_grad,
            bf16=bf16,
            params_dtype=model.config.params_dtype,
            use_distributed_optimizer=distributed_optimizer,
        ),
        [ddp],
    )
    before = [param.detach().float().clone() for param in model.parameters()]
    s = options.seq_length
    tokens = torch.randint(
        0, options.vocab_size, (2, s), generator=torch.Generator().manual_seed(0)
    )
    loss = ddp(tokens, torch.arange(s).expand(2, s), causal_attention_mask(s, "cpu"), labels=tokens)
    loss.float().mean().backward()
    ddp.finish_grad_sync()
    update_successful, grad_norm, _ = optimizer.step()
    assert update_successful

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    squared = torch.zeros(())
    for old, param in zip(before, model.parameters(), strict=True):
        if getattr(param, "tensor_model_parallel", False) or tp_rank == 0:
            squared += (param.detach().float() - old).square().sum()
    torch.distributed.all_reduce(squared, group=parallel_state.get_tensor_model_parallel_group())
    final_norm = model.decoder.final_layernorm.weight.detach().float().clone()
    return grad_norm, squared.sqrt().item(), final_norm


@needs_no_cuda
def test_sgd_step_clips_gradients_under_tp2():
    """SGD without weight decay moves the parameters by exactly lr * clipped gradient."""
    lr, clip_grad = 0.5, 0.01
    results = run_on_ranks(_optimizer_step, 2, args=(False, False, lr, clip_grad))
    (grad_norm, update_norm, norm_weight), (grad_norm1, _, norm_weight1) = results
    assert grad_norm == pytest.approx(grad_norm1)
    assert grad_norm > 10 * clip_grad  # so clipping really scaled the gradients down
    assert update_norm == pytest.approx(lr * clip_grad, rel=1e-4)
    torch.testing.assert_close(norm_weight, norm_weight1, rtol=0, atol=0)


@needs_no_cuda
def test_bf16_distributed_optimizer_step_runs_under_tp2():
    """bf16 params with fp32 main params in the distributed optimizer, clipping on."""
    results = run_on_ranks(_optimizer_step, 2, args=(True, True, 1e-3, 0.01))
    (grad_norm, update_norm, norm_weight), (grad_norm1, _, norm_weight1) = results
    assert grad_norm == pytest.approx(grad_norm1)
    assert torch.isfinite(torch.tensor(grad_norm)) and grad_norm > 0.01
    assert update_norm > 0
    torch.testing.assert_close(norm_weight, norm_weight1, rtol=0, atol=0)


def _checkpoint_round_trip(path: str) -> bool:
    """dist_checkpointing save, then load into zeroed weights; True if all came back.

    A synchronous save runs the async writer and its finalize step in this process (both call
    ``torch.cuda.synchronize``), without the writer process an async save would spawn.
    """
    from megatron.core import dist_checkpointing

    model = build_gpt_model(TINY)
    saved = {name: param.detach().clone() for name, param in model.named_parameters()}
    dist_checkpointing.save(model.sharded_state_dict(), path)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), path))
    return all(torch.equal(param, saved[name]) for name, param in model.named_parameters())


@needs_no_cuda
def test_dist_checkpoint_round_trip_under_tp2(tmp_path):
    assert run_on_ranks(_checkpoint_round_trip, 2, args=(str(tmp_path),)) == [True, True]
