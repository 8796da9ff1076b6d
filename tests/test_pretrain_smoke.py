"""End-to-end: pretrain_gpt_domino.py trains on a prepared dataset and the loss falls."""

import json

import pytest
from launch import TINY_GPT, run_pretrain, train_records

from megatron_domino.data.corpus import stdlib_corpus
from megatron_domino.data.prepare import SentencePieceSettings, prepare

pytestmark = pytest.mark.slow


def test_tp2_run_on_a_prepared_dataset_decreases_the_loss(tmp_path):
    data = prepare(
        corpus=stdlib_corpus(max_bytes=300_000),
        output_dir=tmp_path / "data",
        settings=SentencePieceSettings(vocab_size=512),
    )
    log_json = tmp_path / "log.jsonl"
    output = run_pretrain(
        [
            *TINY_GPT,
            "--tensor-model-parallel-size", "2",
            "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
            "--lr", "3e-3", "--lr-warmup-iters", "3", "--train-iters", "24",
            "--data-path", data.data_prefix, "--split", "90,10,0",
            "--tokenizer-type", "SentencePieceTokenizer",
            "--tokenizer-model", str(data.tokenizer_model),
            "--eval-interval", "12", "--eval-iters", "2",
            "--log-throughput", "--log-json", str(log_json),
        ],
        cwd=tmp_path,
    )  # fmt: skip
    losses = [record["loss"] for record in train_records(log_json).values()]
    assert len(losses) == 24
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.5, losses
    validation = [json.loads(line) for line in log_json.read_text().splitlines()]
    assert [r["iteration"] for r in validation if r["kind"] == "validation"] == [12, 24]
    assert "throughput per GPU (TFLOP/s/GPU)" in output and "tokens/s" in output
    assert "Summary" in output and str(log_json) in output


def test_one_plain_python_process_trains(tmp_path):
    log_json = tmp_path / "log.jsonl"
    run_pretrain(
        [
            *TINY_GPT, "--lr", "1e-3", "--train-iters", "2",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
            "--data-cache-path", str(tmp_path / "cache"), "--log-json", str(log_json),
        ],
        cwd=tmp_path,
        nproc=None,
    )  # fmt: skip
    assert sorted(train_records(log_json)) == [1, 2]
