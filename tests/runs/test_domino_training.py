"""``pretrain_gpt_domino.py --domino`` trains exactly like the run without it.

Each case launches the real training script (Megatron-LM's own ``pretrain()``) twice on
gloo ranks as torchrun runs it (see :mod:`launch`), with the same seed, mock data (``NullTokenizer``)
and flags, once without and
once with ``--domino`` (two cases whose flags differ only in Domino's share the run without),
for 20 optimizer steps, and compares the ``--log-json`` records of
every iteration: the loss, the gradient norm before clipping, the learning rate (exactly) and
that no step was skipped. Dropout is off, so the two runs differ only in how Domino
orders the work. Each case also checks that the loss fell, so a broken run (both arms equally
untrained) cannot pass, and that the Domino arm really ran Domino (the banner names its
config, printed by the pre-wrap hook that applied it) rather than silently the stock path.

Cases (tiny GPT: 2 layers, hidden 64, 4 heads, sequence 32), each proving something the other
training-loop tests do not:

* ``tp2-ddp-accumulation``: TP = 2, DP = 1, Megatron DDP, micro-batch 4, global batch 8
  (2 accumulation steps), RMSNorm + SwiGLU + RoPE + GQA (2 query groups) + no linear bias;
  Domino ``--domino-chunks 2``: the batch split in the loop, alone.
* ``tp2-dp2-overlap-grad-reduce``: TP = 2 x DP = 2 (4 ranks), ``--overlap-grad-reduce``,
  micro-batch 2, global batch 8 (2 accumulation steps, so DDP's ``no_sync`` matters),
  LayerNorm + GeLU + learned positions + biases, full activation recompute of every layer
  (``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1``);
  Domino ``--domino-chunks 2 --domino-column-chunks 2``: plain DDP's bucketed, overlapped
  gradient reduction under accumulation, with biases and full recompute.
* ``tp2-sp-sequence-split-mb1``: TP = 2, micro-batch 1 (4 accumulation steps),
  ``--sequence-parallel`` (the local spec with SP-capable norms, ``megatron_domino.specs.cpu_specs``),
  the RMSNorm/SwiGLU/RoPE/GQA model; Domino ``--domino-split sequence --domino-chunks 4``
  (chunk-major layout; the norms' gradients summed by Megatron's ``finalize_model_grads``):
  the users' layout (TP + SP, micro-batch 1) without pipeline stages.
* ``tp2-auto``: the first case with ``--domino-chunks auto --domino-auto-iters 1``: the
  tuner runs 7 candidates (p2, p2-k2, p4, p4-k2, p1-k2, s2, s4) for a warm-up and a measured
  iteration each, switching the setting between optimizer steps (iterations 1-14), then its
  choice; every iteration must still match the baseline, and the choice is logged.

What other tests prove is not run again here (each was a case of this file before): bf16 and
the distributed optimizer in the loop: the Llama example of
``tests/runs/test_megatron_lm_examples.py`` (bf16, ``--use-distributed-optimizer
--overlap-grad-reduce --overlap-param-gather``), with each setting's bf16 numerics against
stock in ``tests/ranks/test_domino_equivalence.py``; selective recompute of the core attention:
``tests/ranks/test_domino_recompute.py``, against stock's same recompute; Megatron-Core's 1F1B pipeline schedule in the
loop: the GPT-3 example (TP 2 x PP 2) and ``tests/runs/test_domino_vpp.py`` (the batch split
under the interleaved schedule), with the batch split's 1F1B numerics in
``tests/ranks/test_domino_pipeline.py``.

Tolerances (relative to the baseline, per iteration, on the loss and on the grad norm):

* fp32: ``rtol = 1e-5``. Domino runs the same GEMMs on fewer rows (chunks) and sums the
  row-parallel output in pieces (column chunks), so only the order of floating-point sums
  changes, and Adam carries those roundings forward from step to step. Worst observed over the
  20 steps (loss / grad norm): ``tp2-ddp-accumulation`` 1.2e-7 / 1.1e-7,
  ``tp2-dp2-overlap-grad-reduce`` 1.1e-7 / 1.9e-7. The grad norm is the sharper check: scaling Domino's QKV and fc1 weight
  gradients by 1 + 1e-4 moves it by 2.6e-5 relative (and fails this test) while the loss moves
  by only 3.5e-7; a schedule bug (a chunk added to the wrong residual, a lost piece or
  all-reduce) is off by far more.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import pytest
from launch import records, run_pretrain, train_records

from megatron_domino.training.runs import cpu_flags

pytestmark = pytest.mark.slow

TRAIN_ITERS = 20

#: Shared by every case and both arms: model size, schedule, data, no dropout.
COMMON = [
    *cpu_flags(),
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--tensor-model-parallel-size", "2",
    "--attention-dropout", "0", "--hidden-dropout", "0",
    "--lr", "3e-3", "--lr-warmup-iters", "2", "--train-iters", str(TRAIN_ITERS),
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200",
    "--log-interval", "10", "--eval-interval", "1000", "--eval-iters", "0",
]  # fmt: skip

MODERN_MODEL = [
    "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
    "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
]  # fmt: skip

FP32_RTOL = {"loss": 1e-5, "grad_norm": 1e-5}


@dataclass(frozen=True)
class Case:
    """One layout and model, trained without and with Domino."""

    nproc: int
    """Ranks: 2 for TP = 2, 4 for TP = 2 x DP = 2."""
    flags: list[str]
    """Flags added to :data:`COMMON` in both arms."""
    chunks: int
    column_chunks: int
    rtol: dict[str, float]
    """Largest relative difference allowed, by ``--log-json`` key."""
    split_along: str = "batch"
    auto_iters: int | None = None
    """``--domino-auto-iters`` with ``--domino-chunks auto`` (``chunks`` etc. then unused)."""

    @property
    def domino_flags(self) -> list[str]:
        if self.auto_iters is not None:
            return [
                "--domino",
                "--domino-chunks",
                "auto",
                "--domino-auto-iters",
                str(self.auto_iters),
            ]
        return [
            "--domino",
            "--domino-chunks", str(self.chunks),
            "--domino-column-chunks", str(self.column_chunks),
            "--domino-split", self.split_along,
        ]  # fmt: skip


CASES = {
    "tp2-ddp-accumulation": Case(
        nproc=2,
        flags=[*MODERN_MODEL, "--micro-batch-size", "4", "--global-batch-size", "8"],
        chunks=2, column_chunks=1, rtol=FP32_RTOL,
    ),
    "tp2-dp2-overlap-grad-reduce": Case(
        nproc=4,
        flags=[
            "--micro-batch-size", "2", "--global-batch-size", "8", "--overlap-grad-reduce",
            "--recompute-granularity", "full", "--recompute-method", "uniform",
            "--recompute-num-layers", "1",
        ],
        chunks=2, column_chunks=2, rtol=FP32_RTOL,
    ),
    "tp2-sp-sequence-split-mb1": Case(
        nproc=2,
        flags=[
            *MODERN_MODEL, "--micro-batch-size", "1", "--global-batch-size", "4",
            "--sequence-parallel", "--spec", "megatron_domino.specs.cpu_specs",
            "sequence_parallel_local_spec",
        ],
        chunks=4, column_chunks=1, rtol=FP32_RTOL, split_along="sequence",
    ),
    "tp2-auto": Case(
        nproc=2,
        flags=[*MODERN_MODEL, "--micro-batch-size", "4", "--global-batch-size", "8"],
        chunks=0, column_chunks=0, rtol=FP32_RTOL, auto_iters=1,
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def mock_data_cache(tmp_path_factory) -> Path:
    """One sample-index cache for every run: both arms read the very same samples."""
    return tmp_path_factory.mktemp("mock-data-cache")


def _train(case: Case, extra: list[str], *, cwd: Path, cache: Path, name: str):
    """Run one arm as its own launch; return its train records by iteration and its output.

    One launch per arm, as a user runs them: each arm's ranks are processes of their own, with
    their own process groups and Megatron state.
    """
    log_json = cwd / f"{name}.jsonl"
    files = ["--data-cache-path", str(cache), "--log-json", str(log_json)]
    output = run_pretrain([*COMMON, *case.flags, *extra, *files], cwd=cwd, nproc=case.nproc)
    return train_records(log_json), output


def _worst_relative_difference(baseline: dict, domino: dict, key: str) -> float:
    return max(abs(domino[i][key] - baseline[i][key]) / abs(baseline[i][key]) for i in baseline)


@pytest.fixture(scope="module")
def baselines() -> dict:
    """Baseline runs by ``(ranks, flags)``: cases that differ only in their Domino flags
    (``tp2-auto`` and ``tp2-ddp-accumulation``) share one, as they would share its records."""
    return {}


@pytest.mark.parametrize("name", CASES)
def test_domino_training_matches_the_baseline(tmp_path, mock_data_cache, baselines, name):
    case = CASES[name]
    arm = functools.partial(_train, case, cwd=tmp_path, cache=mock_data_cache)
    key = (case.nproc, tuple(case.flags))
    if key not in baselines:
        baselines[key] = arm([], name="baseline")
    baseline, baseline_output = baselines[key]
    domino, domino_output = arm(case.domino_flags, name="domino")
    assert "> Domino: off" in baseline_output
    if case.auto_iters is None:
        banner = (
            f"> Domino: DominoConfig(chunks={case.chunks}, column_chunks={case.column_chunks}, "
            f"split_along='{case.split_along}',"
        )
    else:
        banner = "> Domino: AutoTuner(candidates=[p2, p2-k2, p4, p4-k2, p1-k2, s2, s4],"
        (choice,) = records(tmp_path / "domino.jsonl", "domino_auto").values()
        assert choice["iteration"] == 14 and set(choice["medians_s"]) == {
            "p2", "p2-k2", "p4", "p4-k2", "p1-k2", "s2", "s4"
        }  # fmt: skip
        assert choice["medians_s"][choice["choice"]] == min(choice["medians_s"].values())
        assert f"Domino auto: chose {choice['choice']} " in domino_output
    assert banner in domino_output
    iterations = list(range(1, TRAIN_ITERS + 1))
    assert sorted(baseline) == iterations and sorted(domino) == iterations

    for arm_records in (baseline, domino):
        assert not any(r["skipped"] for r in arm_records.values())
        assert all(r["grad_norm"] is not None for r in arm_records.values())
    assert [domino[i]["learning_rate"] for i in iterations] == [
        baseline[i]["learning_rate"] for i in iterations
    ]
    worst = {key: _worst_relative_difference(baseline, domino, key) for key in case.rtol}
    print(f"{name}: worst relative difference {worst}")
    for key, rtol in case.rtol.items():
        assert worst[key] <= rtol, (
            key,
            worst[key],
            [(baseline[i][key], domino[i][key]) for i in iterations],
        )

    losses = [baseline[i]["loss"] for i in iterations]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.5, losses
