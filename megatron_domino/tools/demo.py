"""``make demo``: train a small GPT with tensor parallelism 2 on the CPU, from a fresh clone.

1. Prepare the demo corpus (the Python standard library's own sources) into a SentencePiece
   tokenizer and a Megatron ``.bin/.idx`` dataset under ``data_cache/``; a second run reuses it.
2. Launch ``torchrun --nproc-per-node 2 -m megatron_domino.training ... --domino
   --domino-report`` (what ``pretrain_gpt_domino.py`` runs) exactly as a user would:
   Megatron-LM's own ``pretrain()`` with its own flags (``--tokenizer-type
   SentencePieceTokenizer --tokenizer-model ... --data-path ...``), plus the CPU replacements
   of Megatron-LM's GPU defaults (:data:`megatron_domino.training.runs.CPU_FLAGS`). A 4-layer, h=256 GPT
   (RMSNorm, SwiGLU, RoPE) is split over two gloo ranks, with Domino hiding the
   tensor-parallel all-reduces, trained until the loss has clearly fallen, and saved under
   ``runs/demo/``. The overlap report (:mod:`megatron_domino.analysis.report`) is printed after
   iterations 2 to 4. The log is streamed, less Megatron's listing of all its arguments.
3. Print the first and last loss, throughput, how much communication Domino hid (the last
   overlap report's totals) and wall time, read back from the run's ``--log-json`` record.

It takes about four minutes on two idle cores (the training run 3 to 4, plus under a minute
to prepare the data the first time). Flags given to the demo are appended to the training
flags and win over them (``megatron-domino-demo --train-iters 20``).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from megatron_domino.analysis.report import headline
from megatron_domino.data.corpus import stdlib_corpus
from megatron_domino.data.prepare import PreparedData, SentencePieceSettings, prepare
from megatron_domino.training.runs import cpu_flags, environment, read_records, torchrun_command

DATA_DIR = Path("data_cache") / "stdlib"
RUN_DIR = Path("runs") / "demo"
TENSOR_PARALLEL_SIZE = 2
#: A smaller vocabulary than a real model's keeps the output layer from dominating the cost.
VOCAB_SIZE = 8000

#: Domino on, and its overlap report on the iterations after the first.
EXTRA_FLAGS: list[str] = ["--domino", "--domino-report"]

GPT_MODEL_ARGS = [
    "--num-layers", "4",
    "--hidden-size", "256",
    "--num-attention-heads", "8",
    "--seq-length", "256",
    "--max-position-embeddings", "256",
    "--normalization", "RMSNorm",
    "--swiglu",
    "--position-embedding-type", "rope",
    "--disable-bias-linear",
    "--attention-dropout", "0",
    "--hidden-dropout", "0",
]  # fmt: skip
TRAINING_ARGS = [
    "--micro-batch-size", "8",
    "--global-batch-size", "16",
    "--train-iters", "100",
    "--lr", "3e-3",
    "--min-lr", "3e-4",
    "--lr-warmup-iters", "10",
    "--lr-decay-style", "cosine",
    "--weight-decay", "0.1",
    "--clip-grad", "1.0",
    "--adam-beta2", "0.95",
]  # fmt: skip
MODEL_PARALLEL_ARGS = ["--tensor-model-parallel-size", str(TENSOR_PARALLEL_SIZE)]
EVAL_AND_LOGGING_ARGS = [
    "--eval-interval", "50",
    "--eval-iters", "4",
    "--log-interval", "5",
    "--log-throughput",
    "--log-json", str(RUN_DIR / "log.jsonl"),
]  # fmt: skip
CHECKPOINT_ARGS = [
    "--save", str(RUN_DIR / "checkpoints"),
    "--save-interval", "100",
]  # fmt: skip

#: Megatron-LM prints every argument (several hundred lines) between these two lines.
ARGUMENTS_BEGIN = "------------------------ arguments ------------------------"
ARGUMENTS_END = "-------------------- end of arguments ---------------------"


def data_args(data: PreparedData) -> list[str]:
    return [
        "--data-path", data.data_prefix,
        "--split", "98,2,0",
        "--tokenizer-type", "SentencePieceTokenizer",
        "--tokenizer-model", str(data.tokenizer_model),
        "--data-cache-path", str(DATA_DIR / "index-cache"),
    ]  # fmt: skip


def training_flags(data: PreparedData, extra: Sequence[str]) -> list[str]:
    """The demo's ``pretrain_gpt_domino.py`` flags; ``extra`` last, so its values win."""
    return [
        *cpu_flags(),
        *GPT_MODEL_ARGS,
        *TRAINING_ARGS,
        *MODEL_PARALLEL_ARGS,
        *data_args(data),
        *EVAL_AND_LOGGING_ARGS,
        *CHECKPOINT_ARGS,
        *EXTRA_FLAGS,
        *extra,
    ]


def flag_value(flags: Sequence[str], name: str) -> str:
    """The value of ``name`` in ``flags`` as argparse sees it: the last one given."""
    values = [flags[i + 1] for i, flag in enumerate(flags[:-1]) if flag == name]
    values += [flag.split("=", 1)[1] for flag in flags if flag.startswith(name + "=")]
    if not values:
        raise KeyError(name)
    return values[-1]


def training_environment() -> dict[str, str]:
    # The demo is the CPU one; a GPU here would change what it runs and measures.
    return environment(CUDA_VISIBLE_DEVICES="")


def stream(command: Sequence[str], env: dict[str, str]) -> int:
    """Run ``command``, printing its output but Megatron's argument listing; its status."""
    with subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as process:
        in_arguments = False
        for line in process.stdout:
            if ARGUMENTS_BEGIN in line:
                in_arguments = True
                print("[demo] (Megatron-LM's listing of its arguments left out)", flush=True)
            elif ARGUMENTS_END in line:
                in_arguments = False
            elif not in_arguments:
                print(line, end="", flush=True)
    return process.returncode


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; extra training flags come from ``argv``. Returns the exit status."""
    extra = sys.argv[1:] if argv is None else list(argv)
    started = time.monotonic()
    print(f"[demo] preparing the standard-library corpus in {DATA_DIR} ...", flush=True)
    data = prepare(
        corpus=stdlib_corpus(),
        output_dir=DATA_DIR,
        settings=SentencePieceSettings(vocab_size=VOCAB_SIZE),
    )
    print(
        f"[demo] {data.num_tokens:,} tokens in {data.num_documents} documents, vocabulary "
        f"{data.vocab_size}{' (reused)' if data.reused else ''}",
        flush=True,
    )
    log_json = RUN_DIR / "log.jsonl"
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    log_json.unlink(missing_ok=True)  # the log appends; a new demo starts a new record
    shutil.rmtree(RUN_DIR / "checkpoints", ignore_errors=True)  # and a new checkpoint
    flags = training_flags(data, extra)
    command = torchrun_command(TENSOR_PARALLEL_SIZE, flags)
    print("[demo] " + " ".join(command), flush=True)
    status = stream(command, training_environment())
    if status != 0:
        print(f"[demo] training failed with exit status {status}", file=sys.stderr)
        return status
    tokens = int(flag_value(flags, "--global-batch-size")) * int(flag_value(flags, "--seq-length"))
    print(summary(log_json, tokens_per_iteration=tokens, wall_seconds=time.monotonic() - started))
    return 0


def summary(log_json: Path, *, tokens_per_iteration: int, wall_seconds: float) -> str:
    """The demo's closing lines, computed from the run's JSON-lines record."""
    steps = read_records(log_json, "train")
    validation = read_records(log_json, "validation")
    overlap = read_records(log_json, "domino_report")
    seconds = statistics.median(r["seconds"] for r in steps[1:] or steps)
    lines = [
        "",
        "[demo] done",
        f"  training loss: {steps[0]['loss']:.3f} (iteration {steps[0]['iteration']}) -> "
        f"{steps[-1]['loss']:.3f} (iteration {steps[-1]['iteration']})",
    ]
    if validation:
        lines.append(f"  validation loss: {validation[-1]['loss']:.3f}")
    lines += [
        f"  throughput: {tokens_per_iteration / seconds:.0f} tokens/s, {seconds * 1e3:.0f} ms "
        "per iteration (median over iterations after the first, both ranks together)",
    ]
    if overlap:
        lines.append(
            f"  Domino: {headline(overlap[-1])}; recorded on iteration "
            f"{overlap[-1]['iteration']}, last rank, {overlap[-1]['clock']}"
        )
    lines += [
        f"  wall time: {wall_seconds / 60:.1f} min including data preparation",
        f"  checkpoint: {RUN_DIR / 'checkpoints'}; log: {log_json}",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
