"""Save, then resume: the resumed run computes exactly the losses of the uninterrupted one.

For the numbers to agree, the checkpoint must restore the model, the optimizer moments and
step counts, the learning-rate schedule, the data position and every RNG stream. Two layouts
on two gloo ranks: TP = 2 with dropout on (so the TP-rank-specific RNG stream that attention
dropout draws from matters), and DP = 2 with the distributed optimizer, overlapped gradient
reduction, gradient accumulation and bf16 (so optimizer state is sharded over ranks). And
on four ranks, TP = 2 x PP = 2 with dropout (each stage saves its own layers, optimizer state
and RNG streams).
"""

import pytest
from launch import TINY_GPT, run_pretrain, train_records

from megatron_domino.training.checkpointing import checkpoint_path, latest_iteration

pytestmark = pytest.mark.slow

COMMON = [
    *TINY_GPT,
    "--lr", "1e-3", "--lr-warmup-iters", "1", "--lr-decay-style", "cosine",
    "--train-iters", "4",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200",
]  # fmt: skip
DROPOUT = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
#: layout -> (ranks, flags)
LAYOUTS = {
    "tp2-dropout": (2, [
        "--tensor-model-parallel-size", "2",
        "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
        *DROPOUT,
    ]),
    "dp2-distributed-optimizer-bf16": (2, [
        "--global-batch-size", "8",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--bf16",
    ]),
    "tp2-pp2-dropout": (4, [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", *DROPOUT,
    ]),
}  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS)
def test_resumed_run_matches_the_uninterrupted_run(tmp_path, layout):
    nproc, flags = LAYOUTS[layout]
    run = [*COMMON, *flags, "--data-cache-path", str(tmp_path / "cache")]
    ckpt = tmp_path / "ckpt"
    full, resumed = tmp_path / "full.jsonl", tmp_path / "resumed.jsonl"
    run_pretrain(
        [*run, "--save", str(ckpt), "--save-interval", "2", "--log-json", str(full)],
        cwd=tmp_path,
        nproc=nproc,
    )
    assert latest_iteration(str(ckpt)) == 4
    assert (tmp_path / checkpoint_path("ckpt", 2)).is_dir()

    output = run_pretrain(
        [*run, "--load", str(ckpt), "--ckpt-step", "2", "--log-json", str(resumed)],
        cwd=tmp_path,
        nproc=nproc,
    )
    assert "resuming from iteration 2" in output

    uninterrupted, after_resume = train_records(full), train_records(resumed)
    assert sorted(after_resume) == [3, 4]
    for iteration in (3, 4):
        for key in ("loss", "learning_rate", "grad_norm"):
            assert after_resume[iteration][key] == uninterrupted[iteration][key], (iteration, key)
