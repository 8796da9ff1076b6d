"""Domino on Transformer Engine 2.x's real contract: what TE saves, caches and hands back.

The stand-ins (``te_stand_in``, with TE's FP8 weight contract in ``te_fp8_stand_in``) model,
from TE ``v2.18``'s source: FP8 weights saved as rank-specific plain ``uint8`` tensors when
uncached, ``is_first_microbatch`` as the FP8 weight cache (casts counted), the backward that
overwrites ``main_grad`` on a call flagged first, and ``get_dummy_wgrad``'s shared placeholder.
Each test below fails on the code before the fix it names (issue 16):

* a saved tensor that only looks like the gathered input (same size and leading dimension)
  must come back as it was saved (fix 1: ``saved_shards`` keeps rows of per-token tensors only);
* FP8 + sequence parallelism at the shape where ``n/tp == h ==`` tokens per chunk gives stock's
  gradients (fix 1, end to end);
* one FP8 cast per weight per global batch, as stock, and ``main_grad`` equal to stock's
  (fix 2);
* no weight-sized sum of placeholder gradients in backward (fix 3), for TE's linears and
  Megatron's local ones;
* under FP8 and SP the norm output is gathered, kept and gathered again in FP8, as stock TE
  does (fix 4, its FP8 half): the TP bytes of each direction equal stock's.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from fused_wgrad_stand_in import installed as fused_wgrad_installed
from multiproc import run_on_ranks
from te_stand_in import (
    fp8_stand_in,
    stand_in_linears,
    stand_in_te_layer_spec,
    stand_in_te_norms_apart_layer_spec,
)
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_domino.analysis.collective_bytes import CollectiveBytes
from megatron_domino.analysis.equivalence import (
    forward_backward,
    mismatches,
    token_batch,
    tolerance_for,
)
from megatron_domino.apply import apply_domino
from megatron_domino.harness.gpt_model import GPTOptions, build_gpt_model
from megatron_domino.harness.settings import setting as named_setting
from megatron_domino.recorder import CollectiveLabel, EventRecorder
from megatron_domino.saved_shards import SavedInputRegather

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


# --- fixes 1-3 on the TE stand-ins ----------------------------------------------------------

#: fc1 ``[ffn/tp, h] = [32, 32]`` at TP 2 and 32 tokens per chunk ``[32, 1, 32]`` (b = 2, p = 2):
#: the shape where an FP8 weight's saved bits match the gathered input's size and rows.
COINCIDENT = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    seq_length=32,
    vocab_size=128,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)
MICRO_BATCH = 2


def _options(sequence_parallel: bool) -> GPTOptions:
    return GPTOptions(**COINCIDENT, sequence_parallel=sequence_parallel)


def _fused_main_grads(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Give every stand-in linear's weight a ``main_grad`` and DDP's flag, as Megatron DDP does
    under ``--gradient-accumulation-fusion``; the weights."""
    weights = []
    for linear in stand_in_linears(model):
        linear.fuse_wgrad_accumulation = True
        linear.weight.main_grad = torch.zeros_like(linear.weight, dtype=torch.float32)
        linear.weight.grad_added_to_main_grad = False
        weights.append(linear.weight)
    return weights


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


def _fused_step(model, batch, weights) -> dict:
    """One micro-batch, first of its global batch: casts, ``main_grad`` s, placeholder adds."""
    for linear in stand_in_linears(model):
        linear.is_first_microbatch = True  # Megatron's set_is_first_microbatch
        linear.fp8_casts = 0
    for weight in weights:
        weight.main_grad.zero_()
        weight.grad_added_to_main_grad = False
    model.zero_grad(set_to_none=True)
    with fp8_stand_in():
        loss = model(**batch).float().mean()
    adds = _OutOfPlaceAdds({tuple(weight.shape) for weight in weights})
    with adds:
        loss.backward()
    # A second micro-batch of the same global batch: stock reuses the cached cast.
    with fp8_stand_in():
        model(**batch)
    return dict(
        casts=[linear.fp8_casts for linear in stand_in_linears(model)],
        main_grads=[weight.main_grad.clone() for weight in weights],
        placeholder_adds=adds.count,
    )


def _collective_bytes(model, batch) -> dict:
    """One FP8 forward and backward: TP payload per kind and direction, and the kinds of the
    inputs the TE column linears' GEMMs got (``Float8ActivationTensor`` when FP8 arrived)."""
    inputs = []
    columns = [m for m in stand_in_linears(model) if m.parallel_mode == "column"]
    hooks = [
        m.register_forward_pre_hook(lambda module, args: inputs.append(type(args[0]).__name__))
        for m in columns
    ]
    model.zero_grad(set_to_none=True)
    with CollectiveBytes() as forward, fp8_stand_in():
        loss = model(**batch).float().mean()
    with CollectiveBytes() as backward:
        loss.backward()
    for hook in hooks:
        hook.remove()
    return dict(
        forward=dict(forward.bytes), backward=dict(backward.bytes), inputs=sorted(set(inputs))
    )


def _te_contract(sequence_parallel: bool, setting_name: str) -> dict:
    """Stock against Domino on the TE stand-ins under FP8, at the coincident shape."""
    options = _options(sequence_parallel)
    spec = stand_in_te_norms_apart_layer_spec if sequence_parallel else stand_in_te_layer_spec
    model = build_gpt_model(options, spec=spec())
    batch = token_batch(options, MICRO_BATCH)
    config = named_setting(setting_name).config
    tolerance = tolerance_for(options)
    results = {}
    # Uncached FP8 weights (saved as plain uint8): stock and Domino alike.
    for linear in stand_in_linears(model):
        linear.disable_parameter_transpose_cache = True
    with fp8_stand_in():
        stock = forward_backward(model, batch, finalize_sequence_parallel=True)
    with apply_domino(model, config), fp8_stand_in():
        domino = forward_backward(model, batch, finalize_sequence_parallel=True)
    results["uncached_mismatches"] = mismatches(domino, stock, tolerance)[:3]
    results["stock_bytes"] = _collective_bytes(model, batch)
    with apply_domino(model, config):
        results["domino_bytes"] = _collective_bytes(model, batch)
    for linear in stand_in_linears(model):
        linear.disable_parameter_transpose_cache = False
    # Cached casts, fused weight-gradient accumulation.
    weights = _fused_main_grads(model)
    results["stock"] = _fused_step(model, batch, weights)
    with apply_domino(model, config):
        results["domino"] = _fused_step(model, batch, weights)
    apart = build_gpt_model(options, spec=stand_in_te_norms_apart_layer_spec())
    results["checkpoint_keys"] = sorted(
        value.key for value in apart.sharded_state_dict().values() if hasattr(value, "key")
    )
    return results


@pytest.fixture(
    scope="module",
    params=[(True, "sp-p2"), (False, "p2-no-backward-overlap")],
    ids=["sequence-parallel", "no-sp"],
)
def te_contract(request):
    return request.param[0], run_on_ranks(_te_contract, 2, args=request.param)[0]


def test_fp8_gradients_match_stock_at_the_coincident_shape(te_contract):
    """Uncached FP8 weights (each call saves its ``uint8`` bits): Domino's loss and every
    gradient equal stock's (fix 1, end to end; under SP only the saved shards can break it)."""
    _, results = te_contract
    assert not results["uncached_mismatches"], results["uncached_mismatches"]


def test_fp8_norm_output_gathered_and_kept_in_fp8_as_stock(te_contract):
    """Stock TE under SP casts the norm output's shard to FP8 and gathers the FP8 bits, keeps
    the FP8 shard and gathers it again in backward. Domino's gathers (ahead of the call) and
    re-gathers move the same bytes in each direction, and its column linears get the FP8 input
    (before: the norm output gathered in bf16, twice stock's forward bytes at this shape, and
    its FP8 copy kept whole, so no backward re-gather). Without SP nothing is gathered: equal
    too."""
    sequence_parallel, results = te_contract
    stock, domino = results["stock_bytes"], results["domino_bytes"]
    assert domino["forward"] == stock["forward"], (domino, stock)
    assert domino["backward"] == stock["backward"], (domino, stock)
    if sequence_parallel:
        assert stock["forward"]["all_gather"] > 0
        assert domino["inputs"] == ["Float8ActivationTensor"], domino["inputs"]
    else:
        assert domino["inputs"] == ["Tensor"], domino["inputs"]


def test_one_fp8_cast_per_weight_per_global_batch_and_main_grad_as_stock(te_contract):
    """Stock casts each weight once for the global batch (the second micro-batch reuses the
    cache); so must Domino (fix 2; before: one uncached cast per chunk and micro-batch). Every
    chunk's backward accumulates: ``main_grad`` equals stock's."""
    _, results = te_contract
    stock, domino = results["stock"], results["domino"]
    assert set(stock["casts"]) == {1}, stock["casts"]
    assert domino["casts"] == stock["casts"], domino["casts"]
    for ours, theirs in zip(domino["main_grads"], stock["main_grads"], strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)


def test_no_placeholder_gradients_summed(te_contract):
    """Stock sums no placeholder weight gradients; Domino neither (fix 3; before: p - 1 weight-
    sized adds per weight per micro-batch)."""
    _, results = te_contract
    assert results["stock"]["placeholder_adds"] == 0
    assert results["domino"]["placeholder_adds"] == 0


def _local_placeholder_adds(sequence_parallel: bool) -> tuple[int, int]:
    """Megatron's local linears with the fused weight-gradient stand-in: placeholder adds in
    one backward, stock and Domino p2."""
    options = dataclasses.replace(_options(sequence_parallel), gradient_accumulation_fusion=True)
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


def test_norms_apart_layer_checkpoints_like_the_fused_one(te_contract):
    """``te_spec``'s layer (TENorm + TEColumnParallelLinear) stores its norm weights under the
    fused TE layer's ``torch_dist`` keys (``linear_qkv.layer_norm_weight``, ...), so either
    form loads the other's checkpoints. (The fused stand-in names its norm otherwise than TE,
    so the expected names are TE's own.)"""
    _, results = te_contract
    keys = results["checkpoint_keys"]
    assert not [key for key in keys if "input_layernorm" in key or "pre_mlp_layernorm" in key]
    for fused_name in ("self_attention.linear_qkv.layer_norm_", "mlp.linear_fc1.layer_norm_"):
        assert f"decoder.layers.{fused_name}weight" in keys, keys
