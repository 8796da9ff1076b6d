"""Domino on Transformer Engine 2.x's own code: what TE saves, caches, casts and hands back.

Every test but the first runs TE's own modules (``run_on_ranks(..., te=True)``: TE 2.18's
Python over the CPU backend of its extension, ``tests/te_cpu``) against stock on the same
weights and data:

* a saved tensor that only looks like the gathered input (same size and leading dimension)
  must come back as it was saved (``saved_shards`` keeps rows of per-token tensors only);
* under FP8 and SP, Domino's forward is stock's fused layer's bit for bit: the norm's fp32
  result is cast to FP8 once with the linear's input quantizer, as TE's fused module does (a
  norm run apart and its bf16 output cast again rounds twice: 0.0135 off the loss here);
* at the shape where ``n/tp == h ==`` tokens per chunk (where an FP8 weight's saved bits look
  like the gathered input) the FP8 loss and every gradient are stock's within the bf16 rule,
  with and without SP;
* one FP8 cast per weight per global batch, as stock, and the fused ``main_grad`` (both arms
  from the same FP8 state, :func:`te_models.fp8_start_fixed`) within 2^-7 of stock's,
  norm-relative, and against an fp32 model within the bf16 rule; a control with one chunk's
  weight-gradient GEMM into ``main_grad`` skipped fails both;
* no weight-sized sum of placeholder gradients in backward, for TE's linears and Megatron's
  local ones;
* under FP8 and SP the column linears receive the FP8 gathered input (``Float8Tensor``);
* ``--disable-parameter-transpose-cache`` under FP8 is refused (p casts per micro-batch), TE's
  op-fused MLP is refused by the spec that cannot split it, and TE's activation op
  (``use_te_activation_func``) is built and run as stock builds it.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from contextlib import contextmanager, nullcontext

import pytest
import torch
import torch.distributed as dist
from fused_wgrad_stand_in import installed as fused_wgrad_installed
from multiproc import run_on_ranks
from te_models import (
    fp8_meta_state,
    fp8_start_fixed,
    fused_twin,
    gemms_into,
    load_fp8_meta_state,
    te_spec,
)
from torch.utils._python_dispatch import TorchDispatchMode

from lab.analysis.equivalence import (
    BF16_BOUND,
    compare_with_stock,
    forward_backward,
    fp32_reference_model,
    token_batch,
    tolerance_for,
)
from lab.models.gpt_model import GPTOptions, build_gpt_model
from lab.models.model_options import LLAMA_FLAVOUR
from megatron_domino.apply import apply_domino
from megatron_domino.base.recorder import CollectiveLabel, EventRecorder
from megatron_domino.base.settings import setting as named_setting
from megatron_domino.communication.saved_shards import SavedInputRegather

pytestmark = pytest.mark.te

# --- fix 1, unit: a rank-specific tensor shaped like the gathered input ---------------------


class _Saves(torch.autograd.Function):
    """Saves ``extras`` beside its input, as a linear saves its weight; returns them as seen in
    backward through ``seen``."""

    @staticmethod
    def forward(ctx, input_, seen: list, *extras):
        ctx.save_for_backward(input_, *extras)
        ctx.seen = seen
        return input_ * 2

    @staticmethod
    def backward(ctx, grad):
        _, *extras = ctx.saved_tensors
        ctx.seen.extend(extra.clone() for extra in extras)
        return (grad * 2, None) + (None,) * len(extras)


def _saved_round_trip() -> dict:
    """On each of 2 ranks: gathered input ``[8, 1, 8]`` (8 tokens, h = 8); saved beside it a
    rank-specific ``uint8 [8, 8]`` (an FP8 weight's ``_data``), a rank-specific bf16-of-the-
    same-dtype weight cast ``[8, 8]`` and a per-token function of the input."""
    rank, group = dist.get_rank(), dist.group.WORLD
    shard = torch.arange(32, dtype=torch.float32).reshape(4, 1, 8) + 100 * rank
    gathered = torch.empty(8, 1, 8)
    dist.all_gather_into_tensor(gathered, shard, group=group)
    gathered.requires_grad_(True)
    module = torch.nn.Linear(8, 8, bias=False)  # weight [n/tp = 8, h = 8]
    fp8_data = torch.full((8, 8), 7 + rank, dtype=torch.uint8)
    weight_cast = module.weight.detach().clone() + rank
    per_token = (gathered.detach() * 3).contiguous()  # [s, b/p, h]: not parameter-shaped
    label = CollectiveLabel("attention_regather", 0, 0, EventRecorder())
    regather = SavedInputRegather(group, label, shard)
    packed_shapes, seen = [], []

    def outer_pack(tensor):
        packed_shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(outer_pack, lambda tensor: tensor):
        with regather.keeping_shards(gathered, module):
            out = _Saves.apply(gathered, seen, fp8_data, weight_cast, per_token)
    out.sum().backward()
    return dict(
        data_intact=torch.equal(seen[0], fp8_data),
        cast_intact=torch.equal(seen[1], weight_cast),
        per_token_intact=torch.equal(seen[2], per_token),
        packed_shapes=packed_shapes,
    )


def test_rank_specific_tensors_shaped_like_the_input_come_back_as_saved():
    """The FP8 weight bits and the weight-shaped cast are kept whole (packed ``[8, 8]``), the
    per-token tensor and the input as this rank's rows (``[4, 1, 8]`` each); all come back as
    saved. Before the fix the first two came back stitched from both ranks. (At this shape a
    per-token ``[tokens, h]`` tensor would be parameter-shaped too, and is kept whole.)"""
    for result in run_on_ranks(_saved_round_trip, 2):
        assert result["data_intact"] and result["cast_intact"], result
        assert result["per_token_intact"], result
        assert sorted(result["packed_shapes"]) == [(4, 1, 8), (4, 1, 8), (8, 8), (8, 8)], result


# --- on TE's own modules --------------------------------------------------------------------

#: Llama-flavoured, fc1 ``[2 ffn/tp, h] = [32, 32]`` (SwiGLU) at TP 2 and 32 tokens per chunk
#: ``[32, 1, 32]`` (b = 2, p = 2): the shape where an FP8 weight's saved bits match the gathered
#: input's size and rows.
COINCIDENT = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=32,
    seq_length=32,
    vocab_size=128,
    **LLAMA_FLAVOUR,
)
MICRO_BATCH = 2


def _te_options(sequence_parallel: bool, **changes) -> GPTOptions:
    """The coincident shape on TE layers, bf16 with FP8 (delayed scaling) on."""
    return GPTOptions(
        **COINCIDENT, sequence_parallel=sequence_parallel, transformer_impl="transformer_engine",
        bf16=True, fp8_format="hybrid", **changes,
    )  # fmt: skip


def _te_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Megatron's TE linear wrappers (they carry ``is_first_microbatch``)."""
    return [m for m in model.modules() if hasattr(m, "is_first_microbatch")]


class _OutOfPlaceAdds(TorchDispatchMode):
    """Counts out-of-place ``add`` s whose result has one of ``shapes`` (autograd's sum of two
    gradients of a weight that cannot be summed in place)."""

    def __init__(self, shapes: set) -> None:
        super().__init__()
        self.shapes, self.count = shapes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.add.Tensor and tuple(out.shape) in self.shapes:
            self.count += 1
        return out


@contextmanager
def _second_main_grad_gemm_skipped(weights: list[torch.Tensor]):
    """The broken-on-purpose control: each weight's second weight-gradient GEMM into its
    ``main_grad`` (one chunk's contribution under Domino at p = 2) does nothing."""
    seen = Counter()

    def skip_the_second(call):
        out = call["D"]
        seen[out.data_ptr()] += 1
        return [out, None, None, None] if seen[out.data_ptr()] == 2 else None

    with gemms_into({weight.main_grad.data_ptr() for weight in weights}, skip_the_second):
        yield


def _fused_step(model, batch, *, drop_a_chunk: bool = False) -> dict:
    """Two micro-batches of one global batch with fused weight-gradient accumulation into
    ``main_grad``: weight casts, ``main_grad`` s, placeholder adds in the first backward (with
    ``drop_a_chunk``, :func:`_second_main_grad_gemm_skipped` in it)."""
    from lab.activation_memory import counting_weight_casts

    linears = _te_linears(model)
    weights = [linear.weight for linear in linears]
    for linear in linears:
        linear.fuse_wgrad_accumulation = True
        linear.is_first_microbatch = True  # Megatron's set_is_first_microbatch
    for param in model.parameters():  # as Megatron DDP gives every parameter
        param.main_grad = torch.zeros_like(param, dtype=torch.float32)
        param.grad_added_to_main_grad = False
    model.zero_grad(set_to_none=True)
    broken = _second_main_grad_gemm_skipped(weights) if drop_a_chunk else nullcontext()
    with counting_weight_casts(weights) as casts:
        loss = model(**batch).float().mean()
        adds = _OutOfPlaceAdds({tuple(weight.shape) for weight in weights})
        with adds, broken:
            loss.backward()
        model(**batch)  # the second micro-batch: stock reuses the cached casts
    return dict(
        casts=casts[0],
        main_grads=[weight.main_grad.clone() for weight in weights],
        placeholder_adds=adds.count,
    )


def _column_inputs(model, batch) -> list[str]:
    """The kinds of tensor TE's column linears (``linear_qkv``, ``linear_fc1``) receive in one
    forward, recorded at their class's ``forward``, which Domino's calls pass through."""
    columns = [m for n, m in model.named_modules() if n.endswith(("linear_qkv", "linear_fc1"))]
    classes = {type(module) for module in columns}
    seen, forwards = [], {cls: cls.forward for cls in classes}

    def recording(original):
        def forward(module, inp, *args, **kwargs):
            seen.append(type(inp).__name__)
            return original(module, inp, *args, **kwargs)

        return forward

    for cls, original in forwards.items():
        cls.forward = recording(original)
    try:
        model(**batch)
    finally:
        for cls, original in forwards.items():
            cls.forward = original
    return sorted(set(seen))


def _te_contract(sequence_parallel: bool, setting_name: str) -> dict:
    """Stock against Domino on TE's modules under FP8, at the coincident shape."""
    options = _te_options(sequence_parallel)
    spec = te_spec(sequence_parallel)
    model = build_gpt_model(options, spec=spec)
    batch = token_batch(options, MICRO_BATCH)
    config = named_setting(setting_name).config
    compared = compare_with_stock(
        model, batch, {setting_name: config}, tolerance_for(options),
        fp32_reference=fp32_reference_model(options, model, spec=spec),
    ).settings[setting_name]  # fmt: skip
    results = {"mismatches": compared.mismatches[:3], "left_pending": compared.left_pending}
    # Stock is the layer stock TE builds: under SP the fused norm + linear, whose one rounding
    # of the norm output Domino reproduces (the norms-apart layer rounds twice).
    start = fp8_meta_state(model)  # every fused step below from these FP8 scales and histories
    stock = fused_twin(options, model) if sequence_parallel else model
    if stock is not model:
        forward_backward(stock, batch)  # makes its FP8 state, replaced by model's
    load_fp8_meta_state(stock, start)
    with fp8_start_fixed(stock):
        results["stock"] = _fused_step(stock, batch)
    load_fp8_meta_state(model, start)
    with fp8_start_fixed(model):
        with apply_domino(model, config):
            results["domino"] = _fused_step(model, batch)
            results["dropped"] = _fused_step(model, batch, drop_a_chunk=True)
            results["domino_inputs"] = _column_inputs(model, batch)
    results["fp32"] = _fused_step(fp32_reference_model(options, model, spec=spec), batch)
    return results


@pytest.fixture(
    scope="module",
    params=[(True, "sp-p2"), (False, "p2-no-backward-overlap")],
    ids=["sequence-parallel", "no-sp"],
)
def te_contract(request):
    return request.param[0], run_on_ranks(_te_contract, 2, args=request.param, te=True)[0]


def test_fp8_gradients_match_stock_at_the_coincident_shape(te_contract):
    """FP8 (delayed scaling): Domino's loss and every gradient are stock's within the bf16 rule
    (1.5x stock's own error against fp32), where saved FP8 weight bits look like the input."""
    _, results = te_contract
    assert not results["mismatches"], results["mismatches"]
    assert not results["left_pending"], results["left_pending"]


def test_one_fp8_cast_per_weight_per_global_batch(te_contract):
    """Stock casts each weight once for the global batch (the second micro-batch reuses TE's
    cache); so does Domino, whose chunks never flag a call ``is_first_microbatch=True``."""
    _, results = te_contract
    stock, domino = results["stock"], results["domino"]
    assert stock["casts"] == len(stock["main_grads"]), stock["casts"]
    assert domino["casts"] == stock["casts"], domino["casts"]


#: Domino's fused main_grad against stock's, norm-relative, from the same FP8 state: the casts
#: and scales are stock's, so only the order of the fp32 accumulation differs (each chunk's
#: GEMM adds its share); one bf16 ulp of the largest element is 2^-8 of it.
MAIN_GRAD_BOUND = 2**-7


def _main_grad_problems(results: dict, arm: str) -> list[str]:
    """Weights whose fused ``main_grad`` in ``arm`` is more than :data:`MAIN_GRAD_BOUND` from
    stock's, or further from the fp32 model's than the bf16 rule allows (1.5x stock's own
    error against it, at least 2^-9)."""

    def error(ours, theirs):
        return float((ours.float() - theirs.float()).norm() / theirs.float().norm())

    problems = []
    grads = zip(
        results[arm]["main_grads"],
        results["stock"]["main_grads"],
        results["fp32"]["main_grads"],
        strict=True,
    )
    for index, (ours, stock, exact) in enumerate(grads):
        direct = error(ours, stock)
        if not direct <= MAIN_GRAD_BOUND:
            problems.append(f"weight {index}: {direct:.2e} from stock's")
        limit = BF16_BOUND.limit(error(stock, exact))
        if not error(ours, exact) <= limit:
            problems.append(
                f"weight {index}: {error(ours, exact):.2e} from fp32, limit {limit:.2e}"
            )
    return problems


def test_fused_main_grad_under_fp8_is_stocks(te_contract):
    """Every chunk's backward accumulates into ``main_grad`` (fused weight-gradient GEMMs, never
    overwriting): Domino's equals stock's to accumulation order and holds the bf16 rule
    against fp32; the control with one chunk's GEMM skipped fails both checks."""
    _, results = te_contract
    assert not _main_grad_problems(results, "domino"), _main_grad_problems(results, "domino")
    dropped = _main_grad_problems(results, "dropped")
    assert any("from stock's" in p for p in dropped) and any("from fp32" in p for p in dropped)


def test_no_placeholder_gradients_summed(te_contract):
    """TE returns a shared placeholder weight gradient under fused accumulation; stock sums
    none, and Domino neither (it drops the later chunks' placeholders)."""
    _, results = te_contract
    assert results["stock"]["placeholder_adds"] == 0
    assert results["domino"]["placeholder_adds"] == 0


def test_column_linears_get_the_fp8_gathered_input_under_sp(te_contract):
    """Under SP the norm output is gathered in FP8 and TE's column linears multiply it as it
    came (``Float8Tensor``); without SP nothing is gathered and TE casts the bf16 input."""
    sequence_parallel, results = te_contract
    expected = ["Float8Tensor"] if sequence_parallel else ["Tensor"]
    assert results["domino_inputs"] == expected, results["domino_inputs"]


def _forward_losses() -> tuple[float, float]:
    """Under FP8 + SP, from the same weights and FP8 state: ``(|stock - norms apart without
    Domino|, |stock - Domino|)``, the largest per-token loss differences of one forward."""
    from megatron_domino.base.config import DominoConfig

    os.environ["NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"] = "1"  # TE's FP8 state: our own
    options = _te_options(True)
    stock = build_gpt_model(options, spec=te_spec(True, fused_norms=True))
    apart = build_gpt_model(options, spec=te_spec(True))
    batch = token_batch(options, MICRO_BATCH)
    with torch.no_grad():
        apart.load_state_dict(stock.state_dict())
        reference = stock(**batch)
        plain = apart(**batch)
        apart.load_state_dict(stock.state_dict())  # the FP8 state before the forward again
        with apply_domino(apart, DominoConfig(chunks=2)):
            domino = apart(**batch)
    return (reference - plain).abs().max().item(), (reference - domino).abs().max().item()


def test_fp8_forward_under_sp_is_stocks_bit_for_bit():
    """The norms-apart layer alone rounds the norm output twice (bf16, then FP8); Domino casts
    the norm's fp32 result once with the linear's input quantizer, as the fused module does, so
    its forward equals stock's fused layer exactly."""
    apart_error, domino_error = run_on_ranks(_forward_losses, 2, te=True)[0]
    assert apart_error > 0, "the check needs the double rounding to show"
    assert domino_error == 0.0, domino_error


def _refusal(changes: dict) -> str:
    from megatron_domino.base.config import DominoConfig, DominoUnsupportedError

    model = build_gpt_model(_te_options(True), spec=te_spec(True))
    for name, value in changes.items():
        setattr(model.config, name, value)
    with pytest.raises(DominoUnsupportedError) as error:
        apply_domino(model, DominoConfig(chunks=2))
    return str(error.value)


def test_uncached_fp8_weights_are_refused():
    """``--disable-parameter-transpose-cache`` makes each TE call cast its weight afresh: each
    chunk would cast every weight again (p casts per micro-batch, stock one)."""
    message = run_on_ranks(
        _refusal, 2, args=({"disable_parameter_transpose_cache": True},), te=True
    )[0]
    assert "drop --disable-parameter-transpose-cache" in message, message


def _te_activation() -> tuple[str, bool]:
    """TE's activation op in the MLP (``use_te_activation_func``), bf16 + SP: its type, and
    whether Domino's loss and gradients are stock's within the bf16 rule."""
    options = dataclasses.replace(
        _te_options(True),
        fp8_format=None,
        bias_activation_fusion=False,
        use_te_activation_func=True,
    )
    spec = te_spec(True, use_te_activation_func=True)
    model = build_gpt_model(options, spec=spec)
    compared = compare_with_stock(
        model, token_batch(options, MICRO_BATCH), {"sp-p2": named_setting("sp-p2").config},
        tolerance_for(options), fp32_reference=fp32_reference_model(options, model, spec=spec),
    ).settings["sp-p2"]  # fmt: skip
    return type(model.decoder.layers[0].mlp.activation_func).__name__, compared.passed


def test_te_activation_op_is_built_and_matches_stock():
    """The norms-apart spec builds TE's activation op where the stock TE spec would (before, it
    dropped ``use_te_activation_func`` silently), and Domino runs it as stock."""
    name, passed = run_on_ranks(_te_activation, 2, te=True)[0]
    assert name == "SwiGLU", name
    assert passed


def test_te_op_fused_mlp_is_refused_by_the_spec():
    """``use_transformer_engine_op_fuser`` builds fc1, activation and fc2 as one fused op
    sequence; the norms-apart spec refuses it with the reason instead of dropping it."""
    from types import SimpleNamespace

    from megatron_domino.specs.te_spec import te_norms_apart_block_spec

    config = SimpleNamespace(use_transformer_engine_op_fuser=True, transformer=None)
    with pytest.raises(ValueError, match="op-fused MLP"):
        te_norms_apart_block_spec(config)


def _local_placeholder_adds(sequence_parallel: bool) -> tuple[int, int]:
    """Megatron's local linears with the fused weight-gradient stand-in: placeholder adds in
    one backward, stock and Domino p2."""
    options = GPTOptions(
        **COINCIDENT, sequence_parallel=sequence_parallel, gradient_accumulation_fusion=True
    )
    with fused_wgrad_installed():
        model = build_gpt_model(options)
        weights = [
            module.weight
            for name, module in model.named_modules()
            if name.endswith(("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))
        ]
        counts = []
        for domino in (False, True):
            for param in model.parameters():  # as Megatron DDP gives every parameter
                param.main_grad = torch.zeros_like(param, dtype=torch.float32)
                param.grad_added_to_main_grad = False
            name = "sp-p2" if sequence_parallel else "p2"
            context = apply_domino(model, named_setting(name).config) if domino else nullcontext()
            with context:
                loss = model(**token_batch(options, MICRO_BATCH)).float().mean()
                adds = _OutOfPlaceAdds({tuple(weight.shape) for weight in weights})
                with adds:
                    loss.backward()
            counts.append(adds.count)
    return tuple(counts)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["no-sp", "sequence-parallel"])
def test_no_placeholder_gradients_summed_on_local_linears(sequence_parallel):
    stock, domino = run_on_ranks(_local_placeholder_adds, 2, args=(sequence_parallel,))[0]
    assert stock == 0
    assert domino == 0


def _norm_calls() -> dict[str, int]:
    """Under FP8 + SP, one Domino (``sp-p2``) forward and backward: how many times each TE norm
    module's op ran its forward."""
    options = _te_options(True)
    model = build_gpt_model(options, spec=te_spec(True))
    norms = {
        n: m
        for n, m in model.named_modules()
        if n.endswith(("layernorm", "final_layernorm")) and hasattr(m, "op_forward")
    }
    counted: Counter = Counter()
    classes = {type(module) for module in norms.values()}
    originals = {cls: (cls.op_forward, "op_forward" in vars(cls)) for cls in classes}

    def counting(original):
        def op_forward(self, *args, **kwargs):
            counted[id(self)] += 1
            return original(self, *args, **kwargs)

        return op_forward

    for cls, (original, _) in originals.items():
        cls.op_forward = counting(original)
    try:
        with apply_domino(model, named_setting("sp-p2").config):
            model(**token_batch(options, MICRO_BATCH)).float().mean().backward()
    finally:
        for cls, (original, own) in originals.items():
            if own:
                cls.op_forward = original
            else:
                del cls.op_forward
    return {name: counted[id(module)] for name, module in norms.items()}


def test_one_norm_call_per_chunk_and_sublayer_under_fp8_and_sp():
    """The bf16 norm output and its FP8 cast come from one call of the TE norm (its op with
    the column linear's input quantizer as output quantizer), not a module call and a second
    op call for the cast: each layer norm runs once per chunk (p = 2), the final norm once
    (it runs on the joined output, as stock). Its numerics are stock's fused layer's bit for
    bit on the CPU backend (the test above)."""
    calls = run_on_ranks(_norm_calls, 2, te=True)[0]
    layer_norms = {name: n for name, n in calls.items() if ".layers." in name}
    assert len(layer_norms) == 4 and set(layer_norms.values()) == {2}, calls
    assert calls["decoder.final_layernorm"] == 1, calls
