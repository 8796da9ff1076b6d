"""``pretrain_gpt_domino.py --hybrid-layer-pattern``: Megatron-Core's ``HybridModel`` trained by
Megatron-LM's own loop, as Megatron-LM's ``pretrain_hybrid.py`` builds it
(``hybrid_config_from_args``), with and without ``--domino``: pipeline segments (PP 2) with
Megatron's local layers, and a ``GPTModel`` checkpoint resumed into it through Megatron-Core's
GPT-to-hybrid translation on TE's layers under SP.

``HybridStack``'s final norm is TE's whatever the spec, so the runs go through
``tests/pretrain_te_cpu.py`` (TE's Python over the CPU backend; ranks forked from the TE tests'
fork server, as ``tests/launch.py`` runs that script), with Megatron's
local layers (``--spec megatron_domino.specs.hybrid_spec local_hybrid_stack_spec``). The GPT
checkpoint is written by the same script, on TE's norms-apart layers.
"""

from __future__ import annotations

import re

import pytest
from launch import TE_CPU_SCRIPT, TINY_GPT, run_pretrain, train_records

pytestmark = [pytest.mark.slow, pytest.mark.te]

PATTERN = "*-*-"  # the two-layer GPT of TINY_GPT, each layer cut in two
HYBRID = [
    "--hybrid-layer-pattern", PATTERN,
    "--spec", "megatron_domino.specs.hybrid_spec", "local_hybrid_stack_spec",
]  # fmt: skip
FLAGS = [
    *TINY_GPT, "--tensor-model-parallel-size", "2", "--lr", "1e-3",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
    "--attention-dropout", "0", "--hidden-dropout", "0",
]  # fmt: skip


#: The H100 path's layers on TE's Python: TE layers under SP with their norms apart.
TE_SP = ["--transformer-impl", "transformer_engine", "--sequence-parallel"]


def _hybrid_run(tmp_path, name: str, *extra: str, nproc: int = 2) -> tuple[dict, str]:
    """A hybrid run on ``nproc`` ranks (local layers and :data:`PATTERN` unless ``extra`` gives
    another ``--spec`` or pattern, which Megatron's parser takes last); its training records and
    output."""
    log = tmp_path / f"{name}.jsonl"
    flags = [*FLAGS, *HYBRID, "--data-cache-path", str(tmp_path / "cache"), "--log-json", str(log)]
    output = run_pretrain([*flags, *extra], cwd=tmp_path, nproc=nproc, script=TE_CPU_SCRIPT)
    return train_records(log), output


def test_pipeline_segments_train_as_stock_does(tmp_path):
    """``*-|*-`` on PP 2 (one ``*-`` segment per stage) x TP 2, Megatron's local layers: stock
    and Domino (on each stage's stack, said by the banner) train alike; ``--domino-ab`` and
    ``--domino-report`` run on it (their lines, and the A/B steps are ordinary steps)."""
    segments = ["--hybrid-layer-pattern", "*-|*-", "--pipeline-model-parallel-size", "2"]
    segments += ["--train-iters", "8"]
    stock, _ = _hybrid_run(tmp_path, "stock", *segments, nproc=4)
    loop_flags = ["--domino-ab", "2", "--domino-report", "--domino-report-iters", "1"]
    domino, output = _hybrid_run(tmp_path, "domino", *segments, "--domino", *loop_flags, nproc=4)
    banner = (
        "of HybridModel pattern '*-|*-' (Domino runs every layer of this rank: 1 attention, 1 MLP)"
    )
    assert banner in output
    assert re.search(r"^Domino p2: \d+\.\d\dx stock's iteration time", output, re.MULTILINE)
    assert "[domino-report]" in output
    assert sorted(stock) == sorted(domino) == list(range(1, 9))
    for iteration, step in stock.items():
        assert domino[iteration]["loss"] == pytest.approx(step["loss"], rel=1e-5), iteration


def test_a_gpt_checkpoint_resumes_into_domino_on_the_hybrid_model(tmp_path):
    """A GPT run on TE's norms-apart layers under SP, seeded 7, saves after 2 iterations; stock
    HybridModel and Domino on it (TE's norms-apart ``*`` and ``-`` layers, the default seed)
    load it through Megatron-Core's translation and train 2 more, alike; the control: the
    HybridModel that starts afresh from the default seed trains otherwise (a ``*-*-`` stack
    initialises as the two-layer GPT does, so had the load kept the fresh weights, the resumed
    runs would equal it). (A GPT checkpoint of Megatron's local layers does not load: its final norm is
    torch's, HybridModel's is TE's, whose ``_extra_state`` that checkpoint lacks.)"""
    checkpoint = tmp_path / "gpt"
    gpt = [*FLAGS, *TE_SP, "--spec", "megatron_domino.specs.te_spec", "te_norms_apart_block_spec"]
    gpt += ["--data-cache-path", str(tmp_path / "cache"), "--ckpt-format", "torch_dist"]
    gpt += ["--seed", "7", "--train-iters", "4", "--exit-interval", "2", "--save", str(checkpoint)]
    gpt += ["--save-interval", "2"]
    run_pretrain(gpt, cwd=tmp_path, script=TE_CPU_SCRIPT)
    spec = ["--spec", "megatron_domino.specs.te_hybrid_spec", "te_norms_apart_hybrid_stack_spec"]
    resumed = [*TE_SP, *spec, "--train-iters", "4", "--load", str(checkpoint)]
    resumed += ["--ckpt-format", "torch_dist"]
    stock, _ = _hybrid_run(tmp_path, "stock", *resumed)
    domino, _ = _hybrid_run(tmp_path, "domino", *resumed, "--domino")
    fresh, _ = _hybrid_run(tmp_path, "fresh", *TE_SP, *spec, "--train-iters", "4")
    assert sorted(stock) == sorted(domino) == [3, 4]
    for iteration, step in stock.items():
        assert domino[iteration]["loss"] == pytest.approx(step["loss"], rel=1e-5), iteration
        assert fresh[iteration]["loss"] != pytest.approx(step["loss"], rel=1e-3), iteration
