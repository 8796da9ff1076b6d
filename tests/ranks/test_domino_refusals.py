"""What Domino refuses, with which message; and that revert restores Megatron-Core exactly.

Refusals are checked on a real TP = 2 model: each refused feature is switched on in the model's
``TransformerConfig`` (the object Megatron-Core's modules read) and ``apply_domino`` must raise
before touching anything, naming the feature.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core import package_info
from megatron.core.enums import Fp8Recipe
from multiproc import run_on_ranks
from packaging.version import Version
from tiny_models import TINY

from lab.models.gpt_model import GPTOptions, build_gpt_model, causal_attention_mask
from megatron_domino.apply import apply_domino
from megatron_domino.base.config import DominoConfig, DominoConfigError, DominoUnsupportedError
from megatron_domino.base.version import UnsupportedMegatronVersion, check_megatron_core_version
from megatron_domino.refusals import te_problems

OPTIONS = GPTOptions(num_layers=2, **TINY, num_attention_heads=4)

#: (TransformerConfig attribute, value that must be refused, words the message must contain)
REFUSED = [
    ("tp_comm_overlap", True, "userbuffer"),
    ("enable_cuda_graph", True, "CUDA graphs"),
    ("cuda_graph_impl", "local", "CUDA graphs"),
    ("overlap_moe_expert_parallel_comm", True, "combined-1F1B"),
    ("fp8", "hybrid", "FP8 runs only in Transformer Engine layers"),
    ("fp4", "nvfp4", "FP4 is not supported"),
    ("first_last_layers_bf16", True, "drop --first-last-layers-bf16"),
    ("symmetric_ar_type", "two_shot", "drop --symmetric-ar-type"),
    ("gtp_weight_remat_size", 2, "drop --tensor-parallel-num-weight-shards"),
    ("quant_recipe", "per-module", "per-module quantization recipes"),
    ("mlp_chunks_for_training", 2, "mlp_chunks_for_training splits the MLP"),
]


def _batch(micro_batch: int) -> dict:
    s = OPTIONS.seq_length
    tokens = torch.randint(
        0, OPTIONS.vocab_size, (micro_batch, s), generator=torch.Generator().manual_seed(0)
    )
    return dict(
        input_ids=tokens,
        position_ids=torch.arange(s).expand(micro_batch, s),
        attention_mask=causal_attention_mask(s, "cpu"),
        labels=tokens,
    )


def _refusals_on_tp2() -> dict:
    model = build_gpt_model(OPTIONS)
    config = model.config
    messages = {}
    for name, value, _ in REFUSED:
        original = getattr(config, name)
        setattr(config, name, value)
        try:
            with pytest.raises(DominoUnsupportedError) as error:
                apply_domino(model, DominoConfig(chunks=2))
            messages[name] = str(error.value)
        finally:
            setattr(config, name, original)
        assert not any("forward" in vars(m) for m in model.modules()), (
            "a refused apply patched something"
        )

    with pytest.raises(DominoUnsupportedError) as error:
        apply_domino(model, DominoConfig(chunks=1, column_chunks=3))
    messages["column_chunks"] = str(error.value)

    handle = apply_domino(model, DominoConfig(chunks=4))
    with pytest.raises(RuntimeError, match="already applied"):
        apply_domino(model, DominoConfig(chunks=2))
    with pytest.raises(DominoConfigError, match="not divisible by --domino-chunks 4"):
        model(**_batch(micro_batch=2))
    handle.revert()
    with pytest.raises(RuntimeError, match="already reverted"):
        handle.revert()
    return messages


def test_refused_features_name_the_reason():
    messages = run_on_ranks(_refusals_on_tp2, 2)[0]
    for name, _, words in REFUSED:
        assert words in messages[name], (name, messages[name])
    assert "--domino-column-chunks 3" in messages["column_chunks"]


def _refusal_at_tp1() -> str:
    with pytest.raises(DominoUnsupportedError) as error:
        apply_domino(build_gpt_model(OPTIONS), DominoConfig(chunks=2))
    return str(error.value)


def test_tensor_parallel_size_one_is_refused():
    message = run_on_ranks(_refusal_at_tp1, 1)[0]
    assert "tensor-model-parallel size is 1" in message


def _stock_results(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch)
    loss.mean().backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


def _revert_restores_stock() -> bool:
    model = build_gpt_model(OPTIONS)
    batch = _batch(micro_batch=2)
    forwards = {name: type(m).forward for name, m in model.named_modules()}
    before = _stock_results(model, batch)
    with apply_domino(model, DominoConfig(chunks=2, column_chunks=2)):
        _stock_results(model, batch)
    assert not any("forward" in vars(m) for m in model.modules())
    assert forwards == {name: type(m).forward for name, m in model.named_modules()}
    after = _stock_results(model, batch)
    return all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_revert_restores_stock_behaviour_bit_for_bit():
    assert all(run_on_ranks(_revert_restores_stock, 2))


def test_untested_megatron_version_is_refused():
    for untested in ("0.16.1", "0.20.0"):
        with pytest.raises(UnsupportedMegatronVersion, match=f"megatron-core {untested} is not"):
            check_megatron_core_version(Version(untested))
    assert check_megatron_core_version(Version("0.19.2")) == Version("0.19.2")
    assert check_megatron_core_version() == Version(package_info.__version__)


@pytest.mark.parametrize(
    "recipe",
    [Fp8Recipe.delayed, "delayed", Fp8Recipe.tensorwise, "tensorwise", Fp8Recipe.blockwise],
    ids=["delayed-enum", "delayed-name", "tensorwise-enum", "tensorwise-name", "blockwise"],
)
def test_hopper_fp8_recipes_are_accepted_as_megatrons_enum_or_its_name(recipe):
    """Megatron-Core's ``Fp8Recipe`` is a ``str`` enum; on Python 3.12 its ``str()`` is
    ``Fp8Recipe.delayed``, so the recipe is judged by its value, not by ``str()``."""
    assert te_problems(DominoConfig(chunks=2), sequence_parallel=True, fp8_recipe=recipe) == []


@pytest.mark.parametrize("recipe", [Fp8Recipe.custom, "mxfp8"], ids=["enum", "name"])
def test_other_fp8_recipes_are_refused_by_name(recipe):
    problems = te_problems(DominoConfig(chunks=2), sequence_parallel=True, fp8_recipe=recipe)
    name = getattr(recipe, "value", recipe)
    assert len(problems) == 1 and problems[0].startswith(f"--fp8-recipe {name} ")
    assert "use --fp8-recipe delayed, tensorwise or blockwise" in problems[0]
