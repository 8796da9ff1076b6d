"""Domino under the interleaved pipeline schedule (VPP), in Megatron-LM's own loop.

``pretrain_gpt_domino.py`` at TP = 2 x PP = 2 x VP = 2 (4 ranks; 4 layers, so each rank holds
two model chunks of one layer each, stage 0 layers 0 and 2, stage 1 layers 1 and 3).
Megatron-LM's pre-wrap hook hands Domino the list of this rank's model chunks, one per
virtual stage, and Domino is applied to each (the banner says on how many). The interleaved
1F1B schedule then runs forward of one virtual stage's micro-batch between another's forward
and backward, so each chunk's Domino step must keep its own in-flight collectives.

Two cases, each a stock arm and a Domino arm with the same seed and mock data; every
iteration's loss and grad norm (before clipping) must match within fp32 ``rtol = 1e-5`` (the
bound of ``tests/runs/test_domino_training.py``, whose reasoning applies: only the order of sums
changes), the learning rates exactly:

* ``vp-batch``: no SP, micro-batch 2 (4 micro-batches), ``--num-layers-per-virtual-pipeline-
  stage 1``, Domino ``--domino-chunks 2`` (batch split);
* ``vp-sp-sequence``: ``--sequence-parallel``, micro-batch 1 (4 micro-batches),
  ``--num-virtual-stages-per-pipeline-rank 2``, Domino ``--domino-split sequence
  --domino-chunks 2``. Its Domino arm also saves at iteration 2, and a third launch resumes
  from there: iterations 3 and 4 must equal the uninterrupted arm's bit for bit (both model
  chunks' weights, the optimizer and the schedule come back, and Domino is applied again).

Kept lean: 5 launches of 4 ranks, 4 iterations each (measured on two shared cores: about
1.5 min for ``vp-batch``, 3.9 min for ``vp-sp-sequence`` at a load average of 22); one launch
per arm is the minimum (a second ``init_process_group`` in the same workers hangs).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from launch import run_pretrain, train_records

from megatron_domino.training.runs import cpu_flags

pytestmark = pytest.mark.slow

TRAIN_ITERS = 4
RTOL = 1e-5

COMMON = [
    *cpu_flags(),
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
    "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
    "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
    "--attention-dropout", "0", "--hidden-dropout", "0",
    "--lr", "3e-3", "--lr-warmup-iters", "1", "--train-iters", str(TRAIN_ITERS),
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200",
    "--log-interval", "10", "--eval-interval", "1000", "--eval-iters", "0",
]  # fmt: skip

#: case -> (flags of both arms, Domino's flags)
CASES = {
    "vp-batch": (
        ["--num-layers-per-virtual-pipeline-stage", "1",
         "--micro-batch-size", "2", "--global-batch-size", "8"],
        ["--domino", "--domino-chunks", "2"],
    ),
    "vp-sp-sequence": (
        ["--num-virtual-stages-per-pipeline-rank", "2", "--sequence-parallel",
         "--spec", "megatron_domino.specs.cpu_specs", "sequence_parallel_local_spec",
         "--micro-batch-size", "1", "--global-batch-size", "4"],
        ["--domino", "--domino-split", "sequence", "--domino-chunks", "2"],
    ),
}  # fmt: skip


def _launch(flags: list[str], *, cwd: Path, name: str) -> tuple[dict[int, dict], str]:
    log_json = cwd / f"{name}.jsonl"
    files = ["--data-cache-path", str(cwd / "cache"), "--log-json", str(log_json)]
    output = run_pretrain([*COMMON, *flags, *files], cwd=cwd, nproc=4)
    return train_records(log_json), output


def _assert_matches(baseline: dict, domino: dict) -> None:
    iterations = list(range(1, TRAIN_ITERS + 1))
    assert sorted(baseline) == iterations and sorted(domino) == iterations
    for i in iterations:
        assert not baseline[i]["skipped"] and not domino[i]["skipped"], i
        assert domino[i]["learning_rate"] == baseline[i]["learning_rate"], i
        for key in ("loss", "grad_norm"):
            assert domino[i][key] == pytest.approx(baseline[i][key], rel=RTOL), (i, key)
    assert baseline[TRAIN_ITERS]["loss"] < baseline[1]["loss"] - 0.1, baseline


@pytest.mark.parametrize("name", CASES)
def test_interleaved_pipeline_matches_stock(tmp_path, name):
    flags, domino_flags = CASES[name]
    resume = name == "vp-sp-sequence"
    ckpt = ["--save", str(tmp_path / "ckpt"), "--save-interval", "2"] if resume else []
    baseline, baseline_output = _launch(flags, cwd=tmp_path, name="baseline")
    domino, domino_output = _launch([*flags, *domino_flags, *ckpt], cwd=tmp_path, name="domino")
    assert "> Domino: off" in baseline_output
    assert "> Domino: DominoConfig(" in domino_output
    assert "on 2 model chunk(s)" in domino_output
    _assert_matches(baseline, domino)
    if not resume:
        return
    load = ["--load", str(tmp_path / "ckpt"), "--ckpt-step", "2"]
    resumed, output = _launch([*flags, *domino_flags, *load], cwd=tmp_path, name="resumed")
    assert "successfully loaded checkpoint" in output and "at iteration 2" in output
    assert "on 2 model chunk(s)" in output
    assert sorted(resumed) == [3, 4]
    for i in (3, 4):
        for key in ("loss", "grad_norm", "learning_rate"):
            assert resumed[i][key] == domino[i][key], (i, key)
