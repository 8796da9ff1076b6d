"""Domino on Megatron-LM's production defaults, as far as a CPU runs them.

Megatron-LM trains with fused kernels, bf16, sequence parallelism, Transformer Engine layers
and, in large runs, the distributed optimizer; the other multi-rank tests turn most of that
off. Here :data:`tiny_models.PRODUCTION_DEFAULTS` turns it back on: bf16, ``--sequence-parallel``,
the bias-activation and bias-dropout-add fusions, the masked-softmax flag (at 16 tokens Megatron
takes torch's softmax on any device), gradient-accumulation fusion into fp32 ``main_grad``
(Megatron DDP with ``grad_reduce_in_fp32``, as Megatron-LM sets for bf16; Megatron's fused
kernel is the CPU stand-in :mod:`fused_wgrad_stand_in`), Transformer Engine's layers (TE's own
Python on the CPU, :mod:`te_cpu`; under SP the norms-apart spec Domino runs) and the
distributed optimizer (Adam, clipping on; Megatron-Core's optimizer as it runs without TE's
GPU-only fused Adam and multi-tensor kernels, :func:`te_models.megatron_optimizer_without_te_kernels`).
Dropout stays off so stock and Domino draw nothing and differ only by rounding.

* One micro-batch: stock's and Domino's gradients (``main_grad`` after Megatron's
  ``finalize_model_grads``) against an fp32 reference with the same weights, within
  :data:`lab.analysis.equivalence.BF16_BOUND` of stock's own error, tensor by tensor.
* Three optimizer steps of each from the same weights and batches: losses and gradient norms.
* Which weight-gradient path ran: with gradient-accumulation fusion, every TE linear's weight
  gradient went through TE's fused weight-gradient GEMM (bf16 operands into fp32
  ``main_grad``, read from TE's extension, :func:`te_models.main_grad_gemms`), once per chunk
  under Domino and always accumulating, and the output layer's through Megatron's fused
  GEMM; without sequence parallelism on the local spec, Domino's own column-linear backward
  uses Megatron's fused GEMM (:func:`test_domino_column_linears_use_megatrons_fused_wgrad`).

Tolerances: bf16 bound as above; training ``rtol`` loss 5e-3, grad norm 2e-2 (as the bf16 case
of ``test_domino_training.py``: every reordered bf16 sum rounds, 2**-8 = 4e-3 relative).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
from fused_wgrad_stand_in import installed
from multiproc import run_on_ranks
from te_models import main_grad_gemms, megatron_optimizer_without_te_kernels, te_spec
from tiny_models import PRODUCTION_DEFAULTS, TINY

from lab.analysis.equivalence import (
    BF16_BOUND,
    StepResult,
    bound_violations,
    relative_errors,
    token_batch,
    worst_gradient_error,
)
from lab.models.gpt_model import (
    GPTOptions,
    GPTOptionsError,
    build_gpt_model,
    transformer_config,
)
from megatron_domino.apply import apply_domino
from megatron_domino.base.config import DominoConfig
from megatron_domino.engine.backward_overlap import accumulate_weight_gradient, placeholder_gradient

MICRO_BATCH = 4
CHUNKS = 2
STEPS = 3
TRAIN_RTOL = {"loss": 5e-3, "grad_norm": 2e-2}
OPTIONS = GPTOptions(num_layers=2, **PRODUCTION_DEFAULTS)
#: The production defaults on Transformer Engine's layers (its own Python, :mod:`te_cpu`).
TE_OPTIONS = dataclasses.replace(OPTIONS, transformer_impl="transformer_engine")


# --- the fused weight-gradient call and its placeholder, without a process group -----------


def test_accumulate_weight_gradient_calls_megatrons_kernel_for_the_main_grad_dtype():
    """bf16 operands into an fp32 main_grad: ``wgrad_gemm_accum_fp32``; into a bf16 one:
    ``wgrad_gemm_accum_fp16``; the sum is dY^T X. Without the kernels it refuses."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(12, 8, generator=generator).bfloat16()
    dy = torch.randn(12, 6, generator=generator).bfloat16()
    expected = dy.t().float() @ x.float()
    with pytest.raises(RuntimeError, match="fused_weight_gradient_mlp_cuda"):
        accumulate_weight_gradient(torch.zeros(6, 8), x, dy)
    with installed() as calls:
        main_grad = torch.ones(6, 8)
        accumulate_weight_gradient(main_grad, x, dy)
        torch.testing.assert_close(main_grad, expected + 1, rtol=1e-6, atol=1e-5)
        accumulate_weight_gradient(torch.zeros(6, 8, dtype=torch.bfloat16), x, dy)
        with pytest.raises(RuntimeError, match="Unsupported gradient type"):
            accumulate_weight_gradient(torch.zeros(6, 8, dtype=torch.float64), x, dy)
    assert [(c.kernel, c.input_dtype, c.main_grad_dtype) for c in calls] == [
        ("fp32", torch.bfloat16, torch.float32),
        ("fp16", torch.bfloat16, torch.bfloat16),
    ]


def test_placeholder_gradient_is_one_reused_buffer():
    """Megatron-Core's linear returns a placeholder weight gradient once dW is in main_grad;
    Domino reuses one per shape and dtype instead of allocating one per call."""
    first = placeholder_gradient((6, 8), torch.bfloat16, torch.device("cpu"), zero=False)
    second = placeholder_gradient((6, 8), torch.bfloat16, torch.device("cpu"), zero=True)
    assert first.data_ptr() == second.data_ptr() and not second.any()
    assert second.shape == (6, 8) and second.dtype == torch.bfloat16


def test_fusion_options_reach_the_transformer_config():
    """The production options turn Megatron-LM's fusions on, also on the CPU; the masked
    softmax is refused where Megatron would need its missing CUDA kernel."""
    config = transformer_config(OPTIONS, tensor_model_parallel_size=2)
    assert config.gradient_accumulation_fusion and config.bias_activation_fusion
    assert config.bias_dropout_fusion and config.masked_softmax_fusion
    assert config.bf16 and config.sequence_parallel
    default = transformer_config(
        GPTOptions(num_layers=1, num_attention_heads=4, **TINY), tensor_model_parallel_size=2
    )
    assert not (default.gradient_accumulation_fusion or default.bias_dropout_fusion)
    with pytest.raises(GPTOptionsError, match="scaled_masked_softmax_cuda"):
        transformer_config(
            dataclasses.replace(OPTIONS, seq_length=32), tensor_model_parallel_size=2
        )


# --- Domino's own column-linear backward (no sequence parallelism) -------------------------


def _named_main_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name.removeprefix("module.").removeprefix("module."): param.main_grad.detach().clone()
        for name, param in model.named_parameters()
    }


def _wrap_ddp(model: torch.nn.Module, *, distributed_optimizer: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    return DistributedDataParallel(
        config=model.config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer
        ),
        module=Float16Module(model.config, model),
    )


def _fp32_reference(options: GPTOptions, model: torch.nn.Module, spec) -> StepResult:
    """Loss and gradients of ``model``'s weights in an fp32 model without fusions (the
    ``sequence_parallel`` parameters' gradients summed over TP, as finalize_model_grads does)."""
    reference = build_gpt_model(
        dataclasses.replace(options, bf16=False, gradient_accumulation_fusion=False), spec=spec
    )
    reference.load_state_dict(
        {
            name: value.float() if torch.is_tensor(value) and value.is_floating_point() else value
            for name, value in model.state_dict().items()
        }
    )
    loss = reference(**token_batch(options, MICRO_BATCH))
    loss.mean().backward()
    grads = {}
    for name, param in reference.named_parameters():
        grads[name] = param.grad.detach().clone()
        if getattr(param, "sequence_parallel", False):
            from megatron.core import parallel_state

            dist.all_reduce(grads[name], group=parallel_state.get_tensor_model_parallel_group())
    return StepResult(loss.detach(), grads)


def _micro_batch(ddp, options: GPTOptions) -> StepResult:
    """One forward and backward of ``ddp`` as Megatron-LM's loop runs it; gradients from
    ``main_grad`` after ``finalize_model_grads``."""
    from megatron.core.distributed import finalize_model_grads

    ddp.zero_grad_buffer()
    loss = ddp(**token_batch(options, MICRO_BATCH))
    loss.mean().backward()
    finalize_model_grads([ddp])
    return StepResult(loss.detach(), _named_main_grads(ddp))


#: Domino's settings in :func:`_column_wgrad_calls`: the default, and column pieces (k = 2).
WGRAD_ARMS = {
    "domino": DominoConfig(chunks=CHUNKS),
    "domino-k2": DominoConfig(chunks=CHUNKS, column_chunks=2),
    "domino-k2-autograd-order": DominoConfig(
        chunks=CHUNKS, column_chunks=2, backward_order="autograd"
    ),
}
ROW_WEIGHTS = ("linear_proj.weight", "linear_fc2.weight")


def _column_wgrad_calls(options: GPTOptions) -> dict:
    """Local spec, no SP: stock and Domino main_grads and the fused calls per column and row
    weight (each as ``(kernel, dtypes, tokens, out_features, first main_grad row)``), and the
    gradients that reached each row weight (whether each was the shared placeholder)."""
    with installed() as calls:
        model = build_gpt_model(options)
        ddp = _wrap_ddp(model, distributed_optimizer=False)
        reference = _fp32_reference(options, model, None)
        params = dict(model.named_parameters())
        weights = [n for n in params if n.endswith(("linear_qkv.weight", "linear_fc1.weight"))]
        weights += [n for n in params if n.endswith(ROW_WEIGHTS)]
        reached = {name: [] for name in weights if name.endswith(ROW_WEIGHTS)}
        for name, seen in reached.items():
            params[name].register_hook(lambda grad, seen=seen: seen.append(grad.data_ptr()))

        def row_of(call, name):
            """The first row of ``name``'s main_grad the call accumulated into, or None."""
            main_grad = params[name].main_grad
            offset = call.main_grad_ptr - main_grad.data_ptr()
            row_bytes = main_grad.stride(0) * main_grad.element_size()
            inside = 0 <= offset < main_grad.numel() * main_grad.element_size()
            return offset // row_bytes if inside else None

        found = {}
        for arm in ("stock", *WGRAD_ARMS):
            calls.clear()
            for seen in reached.values():
                seen.clear()
            if arm in WGRAD_ARMS:
                with apply_domino(ddp, WGRAD_ARMS[arm]):
                    result = _micro_batch(ddp, options)
            else:
                result = _micro_batch(ddp, options)
            found[arm] = dict(
                errors=relative_errors(result, reference),
                calls={
                    name: [(c.kernel, c.input_dtype, c.grad_dtype, c.main_grad_dtype, c.tokens,
                            c.out_features, row_of(c, name))
                           for c in calls if row_of(c, name) is not None]
                    for name in weights
                },
                placeholders={
                    name: [ptr == placeholder_gradient(
                        params[name].main_grad.shape, torch.bfloat16, torch.device("cpu"),
                        zero=False).data_ptr() for ptr in seen]
                    for name, seen in reached.items()
                },
            )  # fmt: skip
    return found


def test_domino_column_linears_use_megatrons_fused_wgrad():
    """Without SP, Domino's column linears (QKV, fc1) compute dW in their own backward: with
    gradient-accumulation fusion that is Megatron's fused GEMM with bf16 operands into the
    fp32 main_grad, once per chunk (stock: once per micro-batch), with gradients as close
    to fp32 as stock's."""
    found = _wgrad_calls()
    tokens = OPTIONS.seq_length * MICRO_BATCH
    bf16, fp32 = torch.bfloat16, torch.float32
    for name, calls in found["stock"]["calls"].items():
        out = calls[0][-2]
        assert calls == [("fp32", bf16, bf16, fp32, tokens, out, 0)], (name, calls)
    columns = {n: c for n, c in found["domino"]["calls"].items() if not n.endswith(ROW_WEIGHTS)}
    for name, calls in columns.items():
        out = calls[0][-2]
        assert calls == [("fp32", bf16, bf16, fp32, tokens // CHUNKS, out, 0)] * CHUNKS, name
    assert len(columns) == 2 * OPTIONS.num_layers
    for arm in ("stock", *WGRAD_ARMS):
        name, error = worst_gradient_error(found[arm]["errors"])
        print(f"{arm} vs fp32: worst gradient {error:.2e} ({name})")
    for arm in WGRAD_ARMS:
        wrong = bound_violations(found[arm]["errors"], found["stock"]["errors"], BF16_BOUND)
        assert not wrong, (arm, wrong[:3])


@functools.cache
def _wgrad_calls() -> dict:
    """One launch for the tests of :func:`_column_wgrad_calls`."""
    options = dataclasses.replace(OPTIONS, sequence_parallel=False)
    return run_on_ranks(_column_wgrad_calls, 2, args=(options,), timeout_s=300)[0]


def test_column_pieces_accumulate_into_main_grad_rows():
    """``--domino-column-chunks 2`` with gradient-accumulation fusion: each piece of a row
    linear's GEMM accumulates ``[tokens/p, h/2]`` output gradients into its half of
    ``main_grad`` through Megatron's fused GEMM (bf16 operands, fp32 accumulation), once per
    chunk and piece; no zero-padded full-size ``dW`` per piece reaches the weight, only
    placeholders: with legs one per chunk (each leg is an engine call of its own, in which DDP's
    hook needs a gradient), each a fresh one (not the shared buffer, which ``AccumulateGrad``
    would copy); with autograd's order one per backward, the shared one; main_grad within the
    bf16 bound of stock's (checked above)."""
    found = _wgrad_calls()
    tokens, h = OPTIONS.seq_length * MICRO_BATCH, OPTIONS.hidden_size
    bf16, fp32 = torch.bfloat16, torch.float32
    rows = {n: c for n, c in found["domino-k2"]["calls"].items() if n.endswith(ROW_WEIGHTS)}
    assert len(rows) == 2 * OPTIONS.num_layers
    for name, calls in rows.items():
        assert sorted(calls, key=lambda c: c[-1]) == [
            ("fp32", bf16, bf16, fp32, tokens // CHUNKS, h // 2, row)
            for row in (0, h // 2)
            for _ in range(CHUNKS)
        ], (name, calls)
        assert found["stock"]["calls"][name] == [("fp32", bf16, bf16, fp32, tokens, h, 0)]
    assert found["domino-k2"]["placeholders"] == {name: [False] * CHUNKS for name in rows}
    assert found["domino-k2-autograd-order"]["placeholders"] == {name: [True] for name in rows}


# --- the production defaults: Transformer Engine's layers, SP, fusions, distributed optimizer


def _train(ddp, options: GPTOptions) -> list[dict]:
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=3e-3,
            weight_decay=0.01,
            clip_grad=1.0,
            bf16=True,
            params_dtype=torch.bfloat16,
            use_distributed_optimizer=True,
        ),
        [ddp],
    )
    records = []
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = ddp(**token_batch(options, MICRO_BATCH, seed=100 + step)).mean()
        loss.backward()
        finalize_model_grads([ddp])
        updated, grad_norm, _ = optimizer.step()
        assert updated
        records.append(dict(loss=loss.item(), grad_norm=grad_norm))
    return records


def _production_defaults() -> dict:
    spec = te_spec(True)  # the TE layer Domino runs under SP
    with installed() as calls, megatron_optimizer_without_te_kernels():
        models = [build_gpt_model(TE_OPTIONS, spec=spec) for _ in range(2)]
        models[1].load_state_dict(models[0].state_dict())
        reference = _fp32_reference(TE_OPTIONS, models[0], spec)
        stock, domino = (_wrap_ddp(m, distributed_optimizer=True) for m in models)
        handle = apply_domino(domino, DominoConfig(chunks=CHUNKS))
        with main_grad_gemms(stock) as stock_gemms:
            stock_grads = _micro_batch(stock, TE_OPTIONS)
        calls.clear()
        with main_grad_gemms(domino) as domino_gemms:
            domino_grads = _micro_batch(domino, TE_OPTIONS)
        step = handle.runtime.last_step
        found = dict(
            stock_errors=relative_errors(stock_grads, reference),
            domino_errors=relative_errors(domino_grads, reference),
            left_pending=len(step.pending_forward) + len(step.pending_backward),
            domino_calls={(c.kernel, c.input_dtype, c.grad_dtype, c.main_grad_dtype) for c in calls},
            domino_call_count=len(calls),
            te_gemms={"stock": stock_gemms, "domino": domino_gemms},
            stock_training=_train(stock, TE_OPTIONS),
            domino_training=_train(domino, TE_OPTIONS),
        )  # fmt: skip
    handle.revert()
    return found


@pytest.fixture(scope="module")
def production() -> dict:
    return run_on_ranks(_production_defaults, 2, timeout_s=400, te=True)[0]


@pytest.mark.te
def test_gradients_match_stock_under_production_defaults(production):
    """One micro-batch: Domino's gradients (after finalize_model_grads) are as close to fp32
    as stock's, tensor by tensor; nothing left in flight. Every weight gradient was
    accumulated straight into its fp32 main_grad from bf16 operands: the TE linears' (QKV,
    proj, fc1, fc2) by TE's own fused weight-gradient GEMM, once per chunk under Domino and
    always adding to main_grad (stock's first micro-batch overwrites it, Domino never passes
    ``is_first_microbatch=True``), the output layer's (Megatron's linear) by Megatron's fused
    GEMM, once."""
    assert production["left_pending"] == 0
    for arm in ("stock", "domino"):
        name, error = worst_gradient_error(production[f"{arm}_errors"])
        print(f"{arm} vs fp32: worst gradient {error:.2e} ({name})")
    wrong = bound_violations(production["domino_errors"], production["stock_errors"], BF16_BOUND)
    assert not wrong, wrong[:3]
    bf16, fp32 = torch.bfloat16, torch.float32
    assert production["domino_calls"] == {("fp32", bf16, bf16, fp32)}
    assert production["domino_call_count"] == 1  # the output layer (embedding weight)
    linears = 4 * TE_OPTIONS.num_layers  # QKV, proj, fc1, fc2 per layer
    for arm, overwrites, per_weight in (("stock", True, 1), ("domino", False, CHUNKS)):
        gemms = production["te_gemms"][arm]
        assert {(g.operand_dtypes, g.main_grad_dtype) for g in gemms} == {((bf16, bf16), fp32)}
        assert {g.accumulate for g in gemms} == {not overwrites}, arm
        weights = [g.weight for g in gemms]
        assert len(weights) == linears * per_weight, (arm, weights)
        assert all(weights.count(w) == per_weight for w in weights), (arm, weights)


@pytest.mark.te
def test_distributed_optimizer_steps_match_stock(production):
    """Three Adam steps (distributed optimizer, clipping) from the same weights and batches.
    Megatron-Core's optimizer runs as without TE (torch's AdamW, its own multi-tensor
    functions: :func:`te_models.megatron_optimizer_without_te_kernels`), TE's fused Adam and
    multi-tensor kernels being GPU-only; both arms run the same one."""
    stock, domino = production["stock_training"], production["domino_training"]
    print(f"stock {stock}\ndomino {domino}")
    for key, rtol in TRAIN_RTOL.items():
        for step, (a, b) in enumerate(zip(stock, domino, strict=True)):
            assert abs(b[key] - a[key]) <= rtol * abs(a[key]), (key, step, stock, domino)
    assert stock[-1]["loss"] < stock[0]["loss"]
