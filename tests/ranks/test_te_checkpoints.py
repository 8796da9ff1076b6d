"""Checkpoints between stock's Transformer Engine layer and the layer Domino runs under SP.

Under sequence parallelism Domino runs the TE layer with its norms apart
(:mod:`megatron_domino.specs.te_spec`: ``TENorm`` + ``TEColumnParallelLinear`` instead of the fused
``TELayerNormColumnParallelLinear``). A user's checkpoint comes from stock training, and a
checkpoint Domino saves must resume without Domino, so both models must read each other's
checkpoints: Megatron-LM's ``torch_dist`` format (``dist_checkpointing``, with its default
strictness) and a plain strict ``state_dict`` load, FP8 state (``_extra_state``) included.
Run on TE 2.18's own modules (``te=True``), at TP 2 with FP8 (delayed scaling) on, after a
step so that the FP8 scales are not their initial values.

TE 2.18 stores delayed scaling's FP8 state as a pickle and refuses to load it unless
``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1`` (TE ``pytorch/_extra_state.py``), for stock's
modules as for any: a user loading a delayed-scaling FP8 checkpoint sets it, stock or Domino.
The ranks here set it (the checkpoints are their own), as such a user does.
"""

from __future__ import annotations

import os

import pytest
import torch
from multiproc import run_on_ranks
from te_models import te_spec
from tiny_models import LLAMA_STYLE

pytestmark = pytest.mark.te


def _models():
    """The stock fused TE model and the norms-apart one (different weights), FP8 state set."""

    from lab.analysis.equivalence import forward_backward, token_batch
    from lab.models.gpt_model import GPTOptions, build_gpt_model

    os.environ["NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"] = "1"  # module docstring
    options = GPTOptions(
        **{**LLAMA_STYLE, "num_layers": 1}, sequence_parallel=True,
        transformer_impl="transformer_engine", bf16=True, fp8_format="hybrid",
    )  # fmt: skip
    models = {}
    for seed, (name, spec) in enumerate(
        (
            ("stock", te_spec(True, fused_norms=True)),
            ("domino", te_spec(True)),
        )
    ):
        torch.manual_seed(seed)
        models[name] = build_gpt_model(options, spec=spec)
        with torch.no_grad():  # norm weights start at ones in both: make every value differ
            for param in models[name].parameters():
                param.add_(torch.rand_like(param))
        forward_backward(models[name], token_batch(options, 2, seed=seed))  # FP8 scales move
    return models


#: The fused layer's parameter names -> the norms-apart layer's.
APART_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def _fp8_scales(model: torch.nn.Module) -> dict:
    return {
        name: module.fp8_meta["scaling_fwd"].scale.clone()
        for name, module in model.named_modules()
        if "scaling_fwd" in getattr(module, "fp8_meta", {})
    }


def _torch_dist_both_ways(path: str) -> dict:
    from megatron.core import dist_checkpointing

    found = {}
    for source, target in (("stock", "domino"), ("domino", "stock")):
        models = _models()
        folder = f"{path}/{source}-to-{target}"
        if torch.distributed.get_rank() == 0:
            os.makedirs(folder)
        torch.distributed.barrier()
        dist_checkpointing.save(models[source].sharded_state_dict(), folder)
        try:
            loaded = dist_checkpointing.load(models[target].sharded_state_dict(), folder)
            models[target].load_state_dict(loaded)
        except Exception as error:  # noqa: BLE001 - the message is the finding
            found[f"{source}->{target}"] = f"{type(error).__name__}: {error}"[:300]
            continue
        found[f"{source}->{target}"] = _compare(models[source], models[target])
    return found


def _compare(source: torch.nn.Module, target: torch.nn.Module) -> list:
    """What did not come across: parameters by value (norms under either name), FP8 scales."""
    wrong = []
    by_suffix = {}
    for name, param in source.named_parameters():
        for fused, apart in APART_NAMES.items():
            name = name.replace(fused, apart)
        by_suffix[name] = param
    for name, param in target.named_parameters():
        for fused, apart in APART_NAMES.items():
            name = name.replace(fused, apart)
        if not torch.equal(param, by_suffix[name]):
            wrong.append(name)
    source_scales, target_scales = _fp8_scales(source), _fp8_scales(target)
    for name, scale in target_scales.items():
        if not torch.equal(scale, source_scales[name]):
            wrong.append(f"{name} FP8 scale")
    return wrong


def test_torch_dist_checkpoints_load_both_ways_fp8_state_included(tmp_path):
    """A stock fused checkpoint loads into the model Domino runs, and Domino's into stock's:
    every parameter (the norm weights under the other layer's names) and every FP8 scale
    comes across, with Megatron's default strictness."""
    for rank_found in run_on_ranks(_torch_dist_both_ways, 2, args=(str(tmp_path),), te=True):
        assert rank_found == {"stock->domino": [], "domino->stock": []}, rank_found


def _strict_torch_both_ways() -> dict:
    found = {}
    for source, target in (("stock", "domino"), ("domino", "stock")):
        models = _models()
        try:
            models[target].load_state_dict(models[source].state_dict(), strict=True)
        except RuntimeError as error:
            found[f"{source}->{target}"] = str(error)[:300]
            continue
        found[f"{source}->{target}"] = _compare(models[source], models[target])
    return found


def test_strict_state_dict_loads_both_ways():
    """Plain ``load_state_dict(strict=True)`` between the two layers, both directions."""
    for rank_found in run_on_ranks(_strict_torch_both_ways, 2, te=True):
        assert rank_found == {"stock->domino": [], "domino->stock": []}, rank_found
