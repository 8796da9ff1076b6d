"""The benchmark's DeepSpeed-Domino arm and the SDPA core attention the Megatron arms share.

On 2 gloo ranks, a tiny GPT-3-style model (LayerNorm, GeLU, learned positions, multi-head,
fp32, dropout 0, micro-batch 4):

* the SDPA layer spec computes what the stock local spec computes (same weights), and Domino
  (``p2``, ``p2-k2``) on it matches it unpatched (the sequence split, which binds its own
  core attention onto Megatron's or TE's, refuses it);
* DeepSpeed's ``DominoTransformer`` run in place of the decoder gives the same per-token loss
  and gradients (embeddings, and every decoder weight by name) as Megatron's decoder;
* ``tp_collectives_skipped`` silences DeepSpeed's all-reduces, forward and backward.

Tests needing DeepSpeed skip where it is not installed; the SDPA and refusal tests do not.
"""

from __future__ import annotations

import sys

import pytest
import torch
from multiproc import run_on_ranks
from tiny_models import LLAMA_STYLE, TINY

from lab.bench.deepspeed_arm import deepspeed_problems, init_deepspeed_comm
from lab.bench.sdpa_attention import sdpa_layer_spec
from lab.models.gpt_model import GPTOptions, GPTOptionsError

MICRO_BATCH = 4
OPTIONS = GPTOptions(num_layers=2, **TINY, num_attention_heads=4)
#: Norm-relative error allowed against Megatron's decoder (fp32; only the order of sums and
#: the attention kernel differ). Measured: see the printed numbers.
RELATIVE = 1e-5


def _relative(result, reference) -> dict[str, float]:
    from lab.analysis.errors import relative_errors

    return relative_errors(result, reference)


def _sdpa_against_stock() -> dict:
    """SDPA spec vs stock local spec, then Domino on the SDPA model vs unpatched."""
    from lab.analysis.equivalence import (
        TOLERANCES,
        compare_with_stock,
        forward_backward,
        max_abs_error,
        mismatches,
        token_batch,
    )
    from lab.bench.sdpa_attention import SDPACoreAttention
    from lab.models.gpt_model import build_gpt_model
    from megatron_domino.apply import apply_domino
    from megatron_domino.base.config import DominoUnsupportedError
    from megatron_domino.base.settings import domino_configs, setting

    batch = token_batch(OPTIONS, MICRO_BATCH)
    stock = build_gpt_model(OPTIONS)
    sdpa = build_gpt_model(OPTIONS, spec=sdpa_layer_spec(OPTIONS))
    sdpa.load_state_dict(stock.state_dict())
    assert all(
        isinstance(layer.self_attention.core_attention, SDPACoreAttention)
        for layer in sdpa.decoder.layers
    )
    reference = forward_backward(stock, batch)
    result = forward_backward(sdpa, batch)
    tolerance = TOLERANCES[torch.float32]
    comparison = compare_with_stock(sdpa, batch, domino_configs("p2", "p2-k2"), tolerance)
    # The sequence split binds its own core attention onto Megatron's local or TE attention
    # only: refused here, not silently run with SDPA.
    try:
        apply_domino(sdpa, setting("s2").config)
        sequence_split_refusal = None
    except DominoUnsupportedError as error:
        sequence_split_refusal = str(error)
    return {
        "mismatches": mismatches(result, reference, tolerance),
        "max_abs": max_abs_error(result, reference),
        "relative": _relative(result, reference),
        "domino": {
            name: (row.passed, row.max_error, row.mismatches[:3])
            for name, row in comparison.settings.items()
        },
        "reverted": comparison.reverted,
        "sequence_split_refusal": sequence_split_refusal,
    }


def test_sdpa_spec_matches_stock_and_domino_runs_on_it():
    result = run_on_ranks(_sdpa_against_stock, 2)[0]
    assert not result["mismatches"], result["mismatches"][:3]
    assert max(result["relative"].values()) < RELATIVE
    for name, (passed, max_error, wrong) in result["domino"].items():
        assert passed, (name, wrong)
        print(f"Domino {name} on the SDPA model vs unpatched: max |diff| {max_error:.1e}")
    assert result["reverted"]
    assert "SDPACoreAttention" in (result["sequence_split_refusal"] or ""), result
    print(
        f"SDPA vs stock local spec: max |diff| {result['max_abs']:.1e}, worst norm-relative "
        f"{max(result['relative'].values()):.1e}"
    )


def _in_megatron_names(result, reference):
    """``result`` of the model with DeepSpeed's block, its decoder grads renamed to Megatron's."""
    from lab.analysis.errors import StepResult
    from lab.bench.deepspeed_arm import to_deepspeed_name

    def deepspeed_key(name: str) -> str:
        if not name.startswith("decoder."):
            return name
        return "decoder.block." + to_deepspeed_name(name.removeprefix("decoder."))

    return StepResult(
        result.loss, {name: result.grads[deepspeed_key(name)] for name in reference.grads}
    )


def _count_tp_all_reduces(block, hidden, tp_group, skipped) -> tuple:
    """All-reduces reaching torch on ``tp_group`` in forward and backward of ``block`` alone
    (counted beneath ``skipped``, a context or ``None``), with its output ``[s, b, h]`` and the
    input gradient."""
    import contextlib

    import torch.distributed as dist

    calls = []
    original = dist.all_reduce

    def counting(*args, group=None, **kwargs):
        if group is tp_group:
            calls.append(1)
        return original(*args, group=group, **kwargs)

    dist.all_reduce = counting
    try:
        with skipped if skipped is not None else contextlib.nullcontext():
            hidden = hidden.detach().clone().requires_grad_()
            output = block(hidden, None)
            forward = len(calls)
            # A fixed random projection: the mean square of a LayerNorm output barely
            # depends on its input, so it would give near-zero gradients.
            probe = torch.randn(output.shape, generator=torch.Generator().manual_seed(2))
            (output * probe).sum().backward()
            backward = len(calls) - forward
    finally:
        dist.all_reduce = original
    return forward, backward, output.detach(), hidden.grad


def _deepspeed_against_megatron() -> dict:
    """DeepSpeed's block in place of the decoder vs Megatron's (stock and SDPA attention), and
    its collectives with and without ``tp_collectives_skipped``."""
    from lab.analysis.equivalence import forward_backward, max_abs_error, token_batch
    from lab.bench.deepspeed_arm import (
        build_deepspeed_block,
        deepspeed_decoder,
    )
    from lab.bench.noop_collectives import tp_collectives_skipped
    from lab.models.gpt_model import build_gpt_model

    batch = token_batch(OPTIONS, MICRO_BATCH)
    stock = build_gpt_model(OPTIONS)
    sdpa = build_gpt_model(OPTIONS, spec=sdpa_layer_spec(OPTIONS))
    sdpa.load_state_dict(stock.state_dict())
    block = build_deepspeed_block(stock)
    try:
        build_deepspeed_block(sdpa)
        second_refused = False
    except RuntimeError:
        second_refused = True

    decoder = stock.decoder
    references = {"stock": forward_backward(stock, batch), "sdpa": forward_backward(sdpa, batch)}
    with deepspeed_decoder(stock, block):
        deepspeed = forward_backward(stock, batch)
    restored = stock.decoder is decoder
    report = {"second_refused": second_refused, "restored": restored}
    for name, reference in references.items():
        renamed = _in_megatron_names(deepspeed, reference)
        report[name] = {
            "relative": _relative(renamed, reference),
            "max_abs": max_abs_error(renamed, reference),
            "bitwise": bool(torch.equal(renamed.loss, reference.loss))
            and all(torch.equal(renamed.grads[n], g) for n, g in reference.grads.items()),
        }

    tp_group = stock.decoder.layers[0].self_attention.linear_proj.tp_group
    s, h = OPTIONS.seq_length, OPTIONS.hidden_size
    hidden = torch.randn(s, MICRO_BATCH, h, generator=torch.Generator().manual_seed(1))
    real = _count_tp_all_reduces(block, hidden, tp_group, None)
    skipped = _count_tp_all_reduces(block, hidden, tp_group, tp_collectives_skipped(tp_group))
    report["collectives"] = {
        "real": real[:2],
        "skipped": skipped[:2],
        "output_differs": not torch.allclose(real[2], skipped[2]),
        "input_grad_differs": not torch.allclose(real[3], skipped[3]),
        "max_diff": [
            float((a - b).abs().max()) for a, b in zip(real[2:], skipped[2:], strict=True)
        ],
    }
    return report


def test_deepspeed_block_matches_megatron_decoder():
    pytest.importorskip("deepspeed")
    report = run_on_ranks(_deepspeed_against_megatron, 2)[0]
    assert report["second_refused"] and report["restored"]
    for name in ("stock", "sdpa"):
        errors = report[name]["relative"]
        worst = max(errors, key=errors.get)
        print(
            f"DeepSpeed vs Megatron ({name} attention): loss {errors['loss']:.1e}, word "
            f"embedding grad {errors['embedding.word_embeddings.weight']:.1e}, worst "
            f"{errors[worst]:.1e} ({worst}), max |diff| {report[name]['max_abs']:.1e}, "
            f"bitwise {report[name]['bitwise']}"
        )
        assert errors[worst] < RELATIVE, (name, worst, errors[worst])
    collectives = report["collectives"]
    # Two all-reduces per layer and chunk forward (attention, MLP), two backward (the input
    # gradients of QKV and fc1); none reach torch with the TP collectives skipped.
    per_direction = 2 * OPTIONS.num_layers * 2
    assert collectives["real"] == (per_direction, per_direction), collectives
    assert collectives["skipped"] == (0, 0), collectives
    assert collectives["output_differs"] and collectives["input_grad_differs"], collectives
    print(
        "DeepSpeed block with TP collectives skipped: max |diff| output "
        f"{collectives['max_diff'][0]:.1e}, input gradient {collectives['max_diff'][1]:.1e}"
    )


def test_deepspeed_problems_name_each_reason():
    assert deepspeed_problems(OPTIONS, MICRO_BATCH, sequence_parallel=False) == []
    llama = GPTOptions(num_layers=2, **LLAMA_STYLE)
    text = "\n".join(deepspeed_problems(llama, 3, sequence_parallel=True))
    for word in ("RMSNorm", "SwiGLU", "RoPE", "grouped-query", "sequence parallelism", "odd"):
        assert word in text, word
    dropout = GPTOptions(num_layers=2, **dict(TINY, attention_dropout=0.1), num_attention_heads=4)
    assert "dropout" in "\n".join(deepspeed_problems(dropout, 4, sequence_parallel=False))


def test_sdpa_spec_refuses_what_it_cannot_compute():
    with pytest.raises(GPTOptionsError, match="grouped-query"):
        sdpa_layer_spec(GPTOptions(num_layers=2, **LLAMA_STYLE))
    dropout = GPTOptions(num_layers=2, **dict(TINY, attention_dropout=0.1), num_attention_heads=4)
    with pytest.raises(GPTOptionsError, match="attention-dropout"):
        sdpa_layer_spec(dropout)


def test_missing_deepspeed_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` raises
    with pytest.raises(ImportError, match="make bench DS=1"):
        init_deepspeed_comm()


DEEPSPEED_CASE = {
    "tensor_model_parallel_size": 2,
    "micro_batch_size": MICRO_BATCH,
    "model": dict(num_layers=2, **TINY, num_attention_heads=4),
    "domino": {"p2": {"chunks": 2}},
    "deepspeed": True,
    "sdpa": True,
}


def _bench_case() -> dict:
    from lab.bench.worker import run_case

    return run_case(DEEPSPEED_CASE, iters=1, warmup=0)


def test_bench_runs_the_deepspeed_arm_beside_ours(tmp_path):
    pytest.importorskip("deepspeed")
    from lab.bench.metrics import setting_rows
    from lab.bench.report import markdown_table

    result = {"case": DEEPSPEED_CASE, **run_on_ranks(_bench_case, 2)[0]}
    assert {"deepspeed", "deepspeed_noop", "comm_only[deepspeed]"} <= set(result["arms"])
    # Checked before timing: the same function (bit-identical with SDPA on both sides).
    assert result["deepspeed_check"]["max_relative_loss_difference"] < 1e-6
    # DeepSpeed's p = 2 sends what ours sends, in the layers as two all-reduces per layer and
    # chunk; ours also runs the model's ends per chunk (the embedding's all-reduce forward, the
    # output layer's input-gradient all-reduce backward), which DeepSpeed's runs whole.
    ours, theirs = result["collectives"]["p2"], result["collectives"]["deepspeed"]
    chunks = DEEPSPEED_CASE["domino"]["p2"]["chunks"]
    for phase in ("fwd", "bwd"):
        assert ours[phase]["bytes"] == theirs[phase]["bytes"], phase
        assert ours[phase]["count"] == theirs[phase]["count"] + chunks - 1, phase
    rows = {row["setting"]: row for row in setting_rows(result)}
    assert rows["deepspeed"]["implementation"] == "deepspeed"
    assert rows["p2"]["time_vs_deepspeed"] > 0 and rows["deepspeed"]["time_vs_deepspeed"] == 1.0
    case = {"name": "tiny", "link_mbit": None, **DEEPSPEED_CASE, "rows": list(rows.values())}
    assert "| tiny | p2 |" in markdown_table([case]).split("T_dom / T_deepspeed")[1]
