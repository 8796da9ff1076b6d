"""Domino on Megatron-Core's ``HybridModel`` (megatron-core 0.19's successor of ``GPTModel``,
``--hybrid-layer-pattern``), against the unpatched ``HybridModel`` on the same weights and
data, on TP = 2 (and 4) ranks. Built from :mod:`lab.models.hybrid_model` (the ``*`` and ``-`` layers are
the halves of the GPT layer spec); its final norm is TE's, so the ranks boot TE's Python on the
CPU backend.

* **One step**, loss and every gradient (:func:`compare_with_stock`) and the revert bit-exact,
  for attention and MLP layers in two orders (``*-*-``, ``**--``): Megatron's local layers with
  the batch split (p 2, 4) and the sequence split at TP 2 and 4, with and without sequence
  parallelism, with full recompute; TE's norms-apart layers under SP, in fp32 and in bf16 with FP8 (delayed
  scaling, held to the bf16 rule against an fp32 reference, as ``GPTModel`` is).
* **Training**: Megatron DDP with ``overlap_grad_reduce`` and the distributed optimizer, two
  Adam steps of two micro-batches (``tests/ddp_training.py``): losses, every ``main_grad`` and
  the weights as stock's.
* **The controls**: one gradient 1 % off in Domino's run is flagged; each layer's recorded
  collectives are its own sub-layer's (a ``*`` layer launches no MLP collective), and the
  model's two ends are Domino's as on ``GPTModel``.

Pipeline segments (``*-|*-`` on PP 2) train through Megatron-LM's loop in
``tests/runs/test_pretrain_hybrid.py``.
"""

from __future__ import annotations

import pytest
from ddp_training import differences, train_ddp
from multiproc import run_on_ranks
from te_models import megatron_optimizer_without_te_kernels, te_spec
from tiny_models import LLAMA_STYLE

from lab.analysis.equivalence import (
    compare_with_stock,
    fp32_reference_model,
    token_batch,
    tolerance_for,
)
from lab.models.gpt_model import GPTOptions
from megatron_domino.base.config import DominoConfig
from megatron_domino.base.settings import setting

pytestmark = pytest.mark.te

PATTERNS = ("*-*-", "**--")
FP8 = dict(bf16=True, fp8_format="hybrid", fp8_recipe="delayed")
FULL_RECOMPUTE = dict(
    recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
)
#: Per case: the settings compared, the options' changes, whether on TE's layers.
CASES = {
    "local": (("p2", "s2", "p4"), {}, False),
    "local-sp": (("sp-p2", "sp-s2"), dict(sequence_parallel=True), False),
    "local-recompute": (("p2",), FULL_RECOMPUTE, False),
    "te-sp": (("sp-p2",), dict(sequence_parallel=True), True),
    "te-sp-fp8": (("sp-p2",), dict(sequence_parallel=True, **FP8), True),
}
#: Broken on purpose in Domino's run: the first MLP layer's fc2 weight gradient, 1 % too large.
BROKEN_FACTOR = 1.01


def _options(**changes) -> GPTOptions:
    return GPTOptions(**{**LLAMA_STYLE, "num_layers": 4, **changes})


def _builder(pattern: str):
    from lab.models.hybrid_model import build_hybrid_model

    def build(options, spec=None):
        return build_hybrid_model(options, pattern, spec=spec)

    return build


def _break_one_gradient(model, pattern: str) -> None:
    """Scale one gradient by :data:`BROKEN_FACTOR` while Domino is applied (a parameter hook;
    Domino binds ``forward`` onto the stack instance)."""
    name = f"decoder.layers.{pattern.index('-')}.mlp.linear_fc2.weight"
    parameter = dict(model.named_parameters())[name]
    parameter.register_hook(
        lambda grad: grad * BROKEN_FACTOR if "forward" in vars(model.decoder) else grad
    )


def _compare(case: str, broken: bool) -> dict:
    """On every rank: per pattern, each setting of ``case`` against stock HybridModel (with
    ``broken``, one gradient broken in Domino's run), and the collectives Domino's schedule
    recorded, by name and layer."""
    names, changes, te = CASES[case]
    options = _options(**changes, transformer_impl="transformer_engine" if te else "local")
    spec = te_spec(True) if te else None
    found = {}
    for pattern in PATTERNS:
        build = _builder(pattern)
        model = build(options, spec=spec)
        if broken:
            _break_one_gradient(model, pattern)
        reference = None
        if options.bf16:
            reference = fp32_reference_model(options, model, spec=spec, build=build)
        comparison = compare_with_stock(
            model,
            token_batch(options, 4),
            {name: setting(name).config for name in names},
            tolerance_for(options),
            fp32_reference=reference,
            record=True,
        )
        found[pattern] = dict(
            reverted=comparison.reverted,
            settings={
                name: dict(
                    passed=row.passed,
                    mismatches=row.mismatches[:3],
                    pending=row.left_pending,
                    max_error=row.max_error,
                    collectives=sorted({(span.name, span.layer) for span in row.spans}),
                )
                for name, row in comparison.settings.items()
            },
        )
    return found


@pytest.fixture(scope="module", params=sorted(CASES))
def compared(request):
    return request.param, run_on_ranks(_compare, 2, args=(request.param, False), te=True)[0]


def test_hybrid_model_matches_stock_for_every_pattern_and_setting(compared):
    case, found = compared
    fp32 = not CASES[case][1].get("bf16")
    for pattern, result in found.items():
        assert result["reverted"], (case, pattern)
        for name, row in result["settings"].items():
            assert row["passed"], (case, pattern, name, row["mismatches"], row["pending"])
            if fp32:
                assert row["max_error"] < 1e-6, (case, pattern, name, row["max_error"])


def test_at_tp4_local_layers_match_stock():
    """The local case (p2, s2, p4; ``*-*-`` and ``**--``) on four TP ranks."""
    found = run_on_ranks(_compare, 4, args=("local", False), te=True, timeout_s=300)[0]
    for pattern, result in found.items():
        assert result["reverted"], pattern
        for name, row in result["settings"].items():
            assert row["passed"] and row["max_error"] < 1e-6, (pattern, name, row["mismatches"])


def test_each_layer_runs_its_own_sub_layers_collectives(compared):
    """The recorded collectives of each layer are its sub-layer's (``attention_*`` for ``*``,
    ``mlp_*`` for ``-``), and every layer has some; without SP the model's two ends (the
    embedding's all-reduce, the output layer's input gradient) are Domino's, per chunk."""
    case, found = compared
    for pattern, result in found.items():
        for name, row in result["settings"].items():
            for layer, symbol in enumerate(pattern):
                sublayers = {
                    c.split("_")[0]
                    for c, at in row["collectives"]
                    if at == layer and c.startswith(("attention_", "mlp_"))
                }
                expected = {"attention" if symbol == "*" else "mlp"}
                assert sublayers == expected, (case, pattern, name, layer, row["collectives"])
            if case == "local":  # the model's two ends are Domino's, as on GPTModel
                ends = {c for c, _ in row["collectives"]} & {"embedding_ar", "head_dgrad_ar"}
                assert ends == {"embedding_ar", "head_dgrad_ar"}, (pattern, name, ends)


def test_one_gradient_off_by_one_percent_is_flagged():
    found = run_on_ranks(_compare, 2, args=("local", True), te=True)[0]
    for pattern, result in found.items():
        for name, row in result["settings"].items():
            assert not row["passed"], (pattern, name)


def _ddp_arms() -> dict:
    """``*-*-`` in Megatron DDP with the distributed optimizer: stock, Domino p = 2, and Domino
    under SP, each against its stock."""
    build = _builder("*-*-")
    arms = {}
    with megatron_optimizer_without_te_kernels():  # TE's Python is booted for the final norm
        for name, changes in (("", {}), ("sp-", dict(sequence_parallel=True))):
            options = _options(**changes)
            arms[f"{name}stock"] = train_ddp(options, None, build=build)
            arms[f"{name}domino"] = train_ddp(options, DominoConfig(chunks=2), build=build)
    return arms


def test_ddp_overlap_and_the_distributed_optimizer_train_the_hybrid_model_as_stock():
    arms = run_on_ranks(_ddp_arms, 2, te=True, timeout_s=300)[0]
    for prefix in ("", "sp-"):
        assert not differences(arms[f"{prefix}domino"], arms[f"{prefix}stock"]), prefix
    assert arms["stock"]["steps"][1]["losses"] != arms["stock"]["steps"][0]["losses"]
