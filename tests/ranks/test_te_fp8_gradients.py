"""FP8 ``delayed``, ``tensorwise`` and ``blockwise`` on Transformer Engine's own layers (TE's
Python on the CPU backend, :mod:`te_cpu`): the loss and every gradient of a Domino step against
stock's, with and without sequence parallelism, TP = 2, bf16 with FP8 (``--fp8-format hybrid``;
delayed scaling from one FP8 state for every run, :func:`te_models.fp8_start_fixed`, as its
scales move at every step).

Held by the bf16 rule of :mod:`lab.analysis.equivalence` (:data:`~lab.analysis.equivalence.BF16_BOUND`):
each tensor's norm-relative error against an fp32 model with the same weights within 1.5x
stock's own, at least 2^-9, tensor by tensor (:func:`~lab.analysis.equivalence.compare_with_stock`,
which also checks that nothing is left in flight and that ``revert`` restores stock). Under
delayed scaling Domino's casts and scales are stock's, so it is also held to stock directly:
within 2^-7, norm-relative, per tensor (only the order of sums differs; tensorwise casts each
chunk with its own scale and blockwise cuts the 128 x 1 tiles at chunk boundaries, so there the
bf16 rule is the check). The step is recorded, so that a Domino that did not run cannot pass:
its collectives are counted. Two controls, broken on purpose, must fail:

* the per-chunk amax reduction removed (tensorwise + SP): each rank casts its shard of a chunk
  with its own scale before the gather, so the gathered chunk mixes scales, as the code did
  before the reduction was added (issue 28);
* one gradient 1 % too large (every recipe, under SP: the check can see an error of that size
  under FP8; under delayed scaling the direct check sees it too).

What these shapes do not exercise: TE's FP8 block all-gather (tokens per rank here are not a
multiple of 128, so TE gathers block-scaled tensors in bf16, and so does Domino), which a GPU
run covers (``docs/gpu_check.md``).
"""

from __future__ import annotations

import contextlib

import pytest
from multiproc import run_on_ranks
from te_models import fp8_start_fixed, te_options, te_spec

from lab.analysis.equivalence import (
    compare_with_stock,
    forward_backward,
    fp32_reference_model,
    token_batch,
    tolerance_for,
)
from lab.models.gpt_model import build_gpt_model
from megatron_domino.base.settings import setting

pytestmark = pytest.mark.te

#: Broken on purpose: this gradient 1 % too large in Domino's run.
ONE_PERCENT_OFF = "decoder.layers.1.mlp.linear_fc2.weight"
#: Under delayed scaling from one FP8 state: Domino against stock, norm-relative, per tensor.
DIRECT_BOUND = 2**-7


@contextlib.contextmanager
def _amax_reduction_removed():
    """Domino's gathered casts without their amax reduction (the control)."""
    from megatron_domino.communication import te_fp8_inputs

    gathered_cast = te_fp8_inputs._gathered_cast

    @contextlib.contextmanager
    def each_rank_its_own(quantizer, group=None):
        reduces = getattr(quantizer, "with_amax_reduction", None)
        if reduces is not None:
            quantizer.with_amax_reduction = False
        try:
            with gathered_cast(quantizer, None):
                yield
        finally:
            if reduces is not None:
                quantizer.with_amax_reduction = reduces

    te_fp8_inputs._gathered_cast = each_rank_its_own
    try:
        yield
    finally:
        te_fp8_inputs._gathered_cast = gathered_cast


def _compare(recipe: str, sequence_parallel: bool, control: str | None) -> dict:
    options = te_options(sequence_parallel, bf16=True, fp8_format="hybrid", fp8_recipe=recipe)
    spec = te_spec(sequence_parallel)
    model = build_gpt_model(options, spec=spec)
    batch = token_batch(options, 4)
    name = "sp-p2" if sequence_parallel else "p2-no-backward-overlap"
    broken = contextlib.nullcontext()
    if control == "no amax reduction":
        broken = _amax_reduction_removed()
    elif control == "one percent":
        parameter = dict(model.named_parameters())[ONE_PERCENT_OFF]
        parameter.register_hook(
            lambda grad: grad * 1.01 if "forward" in vars(model.decoder) else grad
        )
    reference = fp32_reference_model(options, model, spec=spec)
    fixed = contextlib.nullcontext()
    if recipe == "delayed":  # TE makes its FP8 state in the first FP8 call; then keep it fixed
        forward_backward(model, batch)
        fixed = fp8_start_fixed(model)
    with broken, fixed:
        comparison = compare_with_stock(
            model, batch, {name: setting(name).config}, tolerance_for(options),
            fp32_reference=reference, record=True,
        )  # fmt: skip
    row = comparison.settings[name]
    return dict(
        mismatches=row.mismatches,
        left_pending=row.left_pending,
        collectives=len(row.spans),
        reverted=comparison.reverted,
        far_from_stock={k: v for k, v in row.relative_to_stock.items() if not v <= DIRECT_BOUND},
    )


RECIPES = ("delayed", "tensorwise", "blockwise")
CASES = [
    pytest.param(recipe, sp, id=f"{recipe}-{'sp' if sp else 'no-sp'}")
    for recipe in RECIPES
    for sp in (True, False)
]


@pytest.mark.parametrize(("recipe", "sequence_parallel"), CASES)
def test_loss_and_every_gradient_within_stocks_fp8_error(recipe, sequence_parallel):
    found = run_on_ranks(_compare, 2, args=(recipe, sequence_parallel, None), te=True)[0]
    assert not found["mismatches"], found["mismatches"][:3]
    assert found["left_pending"] == 0 and found["reverted"]
    assert found["collectives"] >= 8  # Domino's schedule ran: its collectives were recorded
    if recipe == "delayed":
        assert not found["far_from_stock"], found["far_from_stock"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_one_gradient_one_percent_off_fails_it(recipe):
    found = run_on_ranks(_compare, 2, args=(recipe, True, "one percent"), te=True)[0]
    assert [m.split(":")[0] for m in found["mismatches"]] == [ONE_PERCENT_OFF], found["mismatches"]
    if recipe == "delayed":
        assert list(found["far_from_stock"]) == [ONE_PERCENT_OFF], found["far_from_stock"]


def test_without_the_per_chunk_amax_reduction_tensorwise_fails_it():
    found = run_on_ranks(_compare, 2, args=("tensorwise", True, "no amax reduction"), te=True)[0]
    assert found["mismatches"], "the gathered chunks mixed scales and nothing noticed"
