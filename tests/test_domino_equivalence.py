"""Domino computes what unpatched Megatron-Core computes, on the same weights and batch.

Every rank builds one model, runs a forward and backward with the stock block (the
reference), then with Domino applied for each setting in :data:`SETTINGS`, then again after
``revert``. It compares the per-token loss ``[b, s]`` and every parameter's gradient against
the reference, checks that no forward or backward collective is left pending, and that the
reverted model reproduces the reference bit for bit.

Tolerances. fp32: ``atol = 1e-6, rtol = 1e-5``: Domino splits the batch (GEMMs with fewer
rows) and, with column pieces, sums the output-projection's pieces separately, so only the
order of floating-point sums changes; measured differences are below 1e-7. bf16:
``atol = rtol = 2e-2`` (a few bf16 ulps, 2**-8 = 4e-3 relative), since every reordered bf16
sum rounds; a schedule bug (a chunk's output added to the wrong residual, a missing piece)
gives differences of the order of the values themselves.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from multiproc import run_on_ranks

from megatron_domino.config import DominoConfig
from megatron_domino.gpt_model import GPTOptions, build_gpt_model, causal_attention_mask
from megatron_domino.integration import apply_domino

MICRO_BATCH = 4
TOLERANCE = {torch.float32: dict(atol=1e-6, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}

_TINY = dict(
    num_layers=2,
    hidden_size=64,
    seq_length=16,
    vocab_size=300,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)
MODELS = {
    "layernorm-gelu-learned-bias-mha": GPTOptions(**_TINY, num_attention_heads=8),
    "rmsnorm-swiglu-rope-gqa-nobias": GPTOptions(
        **_TINY,
        num_attention_heads=8,
        num_query_groups=4,
        ffn_hidden_size=96,
        normalization="RMSNorm",
        swiglu=True,
        position_embedding_type="rope",
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
    ),
}
MODELS["rmsnorm-swiglu-rope-gqa-nobias-bf16"] = dataclasses.replace(
    MODELS["rmsnorm-swiglu-rope-gqa-nobias"], bf16=True
)

SETTINGS = {
    "p2": dict(chunks=2),
    "p4": dict(chunks=4),
    "p1-k2": dict(chunks=1, column_chunks=2),
    "p2-k4": dict(chunks=2, column_chunks=4),
    "p2-intra-layer": dict(chunks=2, inter_layer=False),
    "p2-no-backward-overlap": dict(chunks=2, backward_overlap=False),
}


def _batch(options: GPTOptions) -> dict[str, torch.Tensor]:
    """The same batch on every rank: tokens, positions and labels ``[b, s]``, mask ``[1, 1, s, s]``."""
    generator = torch.Generator().manual_seed(0)
    s = options.seq_length
    return {
        "input_ids": torch.randint(0, options.vocab_size, (MICRO_BATCH, s), generator=generator),
        "position_ids": torch.arange(s).expand(MICRO_BATCH, s),
        "attention_mask": causal_attention_mask(s, "cpu"),
        "labels": torch.randint(0, options.vocab_size, (MICRO_BATCH, s), generator=generator),
    }


def _forward_backward(model, batch):
    """Per-token loss ``[b, s]`` and the gradients of its mean, by parameter name."""
    model.zero_grad(set_to_none=True)
    loss = model(**batch)
    loss.float().mean().backward()
    return loss.detach(), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _max_error(result, reference) -> float:
    loss, grads = result
    errors = [(loss.float() - reference[0].float()).abs().max()]
    errors += [(grads[name].float() - g.float()).abs().max() for name, g in reference[1].items()]
    return float(max(errors))


def _compare_settings(model_names: list[str], setting_names: list[str]) -> dict:
    """On every rank: each Domino setting against the stock block, for each model."""
    report = {}
    for model_name in model_names:
        options = MODELS[model_name]
        model = build_gpt_model(options)
        batch = _batch(options)
        reference = _forward_backward(model, batch)
        tolerance = TOLERANCE[torch.bfloat16 if options.bf16 else torch.float32]
        for setting in setting_names:
            with apply_domino(model, DominoConfig(**SETTINGS[setting])) as handle:
                result = _forward_backward(model, batch)
                step = handle.runtime.last_step
                assert not step.pending_forward and not step.pending_backward, (
                    "handles left pending"
                )
                launched = len(step.dgrad_slots)
            loss, grads = result
            torch.testing.assert_close(
                loss,
                reference[0],
                **tolerance,
                msg=lambda m, s=setting, mn=model_name: f"{mn} {s} loss: {m}",
            )
            for name, grad in reference[1].items():
                torch.testing.assert_close(
                    grads[name],
                    grad,
                    **tolerance,
                    msg=lambda m, n=name, s=setting, mn=model_name: f"{mn} {s} {n}: {m}",
                )
            report[(model_name, setting)] = {
                "max_error": _max_error(result, reference),
                "dgrad_slots": launched,
            }
        after_revert = _forward_backward(model, batch)
        assert _max_error(after_revert, reference) == 0.0, "revert did not restore stock behaviour"
    return report


def test_every_setting_matches_stock_megatron_at_tp2():
    reports = run_on_ranks(
        _compare_settings, 2, args=(sorted(MODELS), sorted(SETTINGS)), timeout_s=300
    )
    for (model_name, setting), row in reports[0].items():
        # Two linears with an input-gradient all-reduce per layer and chunk.
        chunks = SETTINGS[setting].get("chunks", 2)
        expected = 0 if setting == "p2-no-backward-overlap" else 2 * _TINY["num_layers"] * chunks
        assert row["dgrad_slots"] == expected, (model_name, setting)


@pytest.mark.parametrize("tp", [4, 8])
def test_domino_matches_stock_megatron_at_larger_tp(tp):
    run_on_ranks(
        _compare_settings,
        tp,
        args=(["layernorm-gelu-learned-bias-mha"], ["p2", "p2-k4"]),
        timeout_s=300,
    )


def _dropout_is_identical_across_tp_ranks() -> list[float]:
    """With dropout on, every TP rank must draw the same hidden-dropout masks per chunk."""
    import torch.distributed as dist

    options = dataclasses.replace(
        MODELS["layernorm-gelu-learned-bias-mha"], hidden_dropout=0.2, attention_dropout=0.2
    )
    model = build_gpt_model(options)
    batch = _batch(options)
    with apply_domino(model, DominoConfig(chunks=2)):
        loss, grads = _forward_backward(model, batch)
    gathered = [torch.empty_like(loss) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, loss)
    assert all(torch.equal(g, gathered[0]) for g in gathered), "TP ranks drew different dropout"
    model.eval()
    with torch.no_grad():
        eval_loss = model(**batch)
    return [float(loss.mean()), float(eval_loss.mean())]


def test_dropout_draws_agree_across_tp_ranks():
    train_loss, eval_loss = run_on_ranks(_dropout_is_identical_across_tp_ranks, 2)[0]
    assert train_loss != eval_loss, "dropout was not active in training mode"
