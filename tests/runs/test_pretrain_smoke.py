"""End-to-end: pretrain_gpt_domino.py trains on a prepared dataset and the loss falls."""

import pytest
from launch import TINY_GPT, records, run_pretrain, train_records

from megatron_domino.data.corpus import stdlib_corpus
from megatron_domino.data.prepare import SentencePieceSettings, prepare

pytestmark = pytest.mark.slow


def test_tp2_domino_run_on_a_prepared_dataset_decreases_the_loss(tmp_path):
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
            "--domino", "--domino-report", "--domino-report-iters", "1",
        ],
        cwd=tmp_path,
        torchrun=True,  # the suite's one launch of the training script under torchrun itself
    )  # fmt: skip
    losses = [record["loss"] for record in train_records(log_json).values()]
    assert len(losses) == 24
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.5, losses
    assert sorted(records(log_json, "validation")) == [12, 24]
    # Megatron-LM's own throughput line (its FLOP formula), and Domino's overlap report.
    assert "throughput per GPU (TFLOP/s/GPU)" in output
    assert "[domino-report] iteration 2" in output
    assert sorted(records(log_json, "domino_report")) == [2]


def test_one_plain_python_process_trains(tmp_path, monkeypatch):
    """One process, no launcher; with PYTORCH_NVML_BASED_CUDA_CHECK=1, which ``import deepspeed``
    sets in the importing process (so in a pytest worker that ran the DeepSpeed arm, and in every
    run it starts): torch then answers ``cuda.is_available()`` from the device count the CPU
    loop runtime patches to 1, and the warm-up of Megatron's compiled kernels asked CUDA for a
    stream (the run died)."""
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
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
