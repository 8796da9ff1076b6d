"""Save, then resume: the resumed run computes exactly the losses of the uninterrupted one.

For the numbers to agree, Megatron-LM's checkpoint must restore the model, the optimizer
moments and step counts, the learning-rate schedule, the data position and every RNG stream,
and Domino must come back on the resumed model. The layout: TP = 2 x PP = 2 with ``--domino``
and dropout on (so the TP-rank-specific RNG stream that attention dropout draws from matters,
on each pipeline stage). Megatron-LM saves ``torch_dist`` checkpoints (``--ckpt-format``'s
default) under ``iter_NNNNNNN/`` and ``--ckpt-step`` picks the one to resume.

Resuming elsewhere: at TP = 2 with dropout (the run restarted by torchrun after a kill, and
resubmitted after SIGTERM), ``tests/runs/test_faults.py``; under the interleaved pipeline
schedule with sequence parallelism and ``--ckpt-step``, ``tests/runs/test_domino_vpp.py``.
"""

import pytest
from launch import TINY_GPT, run_pretrain, train_records

pytestmark = pytest.mark.slow

COMMON = [
    *TINY_GPT,
    "--lr", "1e-3", "--lr-warmup-iters", "1", "--lr-decay-style", "cosine",
    "--train-iters", "4",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200",
    "--domino",
]  # fmt: skip
DROPOUT = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]
#: layout -> (ranks, flags)
LAYOUTS = {
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
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert (ckpt / "iter_0000002").is_dir()

    output = run_pretrain(
        [*run, "--load", str(ckpt), "--ckpt-step", "2", "--log-json", str(resumed)],
        cwd=tmp_path,
        nproc=nproc,
    )
    assert "successfully loaded checkpoint" in output and "at iteration 2" in output
    assert "> Domino: DominoConfig(" in output

    uninterrupted, after_resume = train_records(full), train_records(resumed)
    assert sorted(after_resume) == [3, 4]
    for iteration in (3, 4):
        for key in ("loss", "learning_rate", "grad_norm"):
            assert after_resume[iteration][key] == uninterrupted[iteration][key], (iteration, key)
