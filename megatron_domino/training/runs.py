"""Run ``pretrain_gpt_domino.py`` from another program, and read what ``--log-json`` wrote.

The demo, loss parity and the tests start training runs the way a user does (torchrun,
Megatron-LM's own flags); this module is what they share, and imports neither torch nor
Megatron:

* :data:`CPU_FLAGS`: the replacements of Megatron-LM's GPU defaults a CPU run needs, each with
  the reason (the script does not add them silently); the one list of them: the tests, the
  patch's ``cpu_smoke.py`` and ``docs/cpu.md`` (:func:`cpu_flags_markdown`) take it from here,
  and the recipes' ``CPU_ARGS`` are checked against it;
* :func:`torchrun_command` and :func:`environment`: the launch, as ``python -m
  megatron_domino.training`` (what ``pretrain_gpt_domino.py`` runs), so no file is looked up;
* :func:`append_record` and :func:`read_records`: the ``--log-json`` format, one JSON object
  per line with a ``kind`` (``train``, ``validation``, ``test``, ``domino_report``), written by
  :mod:`megatron_domino.training.loop_hooks`.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "CPU_FLAGS",
    "MODULE",
    "QUIET_WARNINGS",
    "append_record",
    "CPU_FLAGS_BEGIN",
    "CPU_FLAGS_END",
    "cpu_flags",
    "cpu_flags_markdown",
    "environment",
    "read_records",
    "torchrun_command",
]

#: What ``python -m`` runs: the body of ``pretrain_gpt_domino.py``.
MODULE = "megatron_domino.training"

#: Megatron-LM's GPU defaults this machine cannot run, each replaced by the flag that says
#: so; nothing else is changed (Megatron's other fusions run on the CPU).
CPU_FLAGS = {
    "--distributed-backend gloo": "NCCL needs a GPU",
    "--transformer-impl local": "Transformer Engine needs CUDA (it is not installed here)",
    "--no-persist-layer-norm": "the persistent LayerNorm is Apex's CUDA kernel; the torch "
    "norm Megatron falls back to refuses it",
    "--no-gradient-accumulation-fusion": "fused weight-gradient accumulation is Apex's CUDA "
    "extension (fused_weight_gradient_mlp_cuda)",
    "--no-masked-softmax-fusion": "in fp16/bf16 the fused softmax is a CUDA extension "
    "(scaled_masked_softmax_cuda); fp32 never uses it",
    "--no-rope-fusion": "the fused rotary embedding is Transformer Engine's (with RoPE only)",
}

#: Messages Megatron-Core prints on every CPU run (and again in its checkpoint writer's
#: process); they say what a CPU machine lacks, which the caller already knows.
QUIET_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "When using async grad allreduce it is recommended",
    "full scope is deprecated",
)


def cpu_flags() -> list[str]:
    """:data:`CPU_FLAGS` as command-line words."""
    return " ".join(CPU_FLAGS).split()


#: The lines of ``docs/cpu.md`` between which :func:`cpu_flags_markdown` stands.
CPU_FLAGS_BEGIN, CPU_FLAGS_END = "<!-- cpu-flags: begin -->", "<!-- cpu-flags: end -->"


def cpu_flags_markdown() -> str:
    """:data:`CPU_FLAGS` as ``docs/cpu.md`` shows them: the command-line words, then a table
    of each flag's reason, between :data:`CPU_FLAGS_BEGIN` and :data:`CPU_FLAGS_END`.

    ``tests/unit/test_cpu_docs.py`` checks the page against it; after changing :data:`CPU_FLAGS`,
    print it (``python -c "from megatron_domino.training.runs import cpu_flags_markdown;
    print(cpu_flags_markdown())"``) and paste it over the page's block."""
    rows = [f"| `{flag}` | {reason} |" for flag, reason in CPU_FLAGS.items()]
    return "\n".join(
        [
            CPU_FLAGS_BEGIN,
            "```",
            " ".join(cpu_flags()),
            "```",
            "",
            "| flag | why (the GPU default it replaces) |",
            "| --- | --- |",
            *rows,
            CPU_FLAGS_END,
        ]
    )


def torchrun_command(nproc: int, flags: Sequence[str]) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node N -m MODULE flags``."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*torchrun, "--nproc-per-node", str(nproc), "-m", MODULE, *flags]


def environment(**overrides: str) -> dict[str, str]:
    """This process's environment for a training run, with what Megatron-LM needs.

    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (Megatron-LM asserts it with TP > 1: on a GPU kernels
    must start in launch order), one OpenMP thread unless set, and :data:`QUIET_WARNINGS`
    silenced; then ``overrides``.
    """
    return {
        **os.environ,
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PYTHONWARNINGS": ",".join(f"ignore:{message}" for message in QUIET_WARNINGS),
        **overrides,
    }


def append_record(path: Path, record: dict) -> None:
    """Append ``record`` as one line to the ``--log-json`` file ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as log:
        log.write(json.dumps(record) + "\n")


def read_records(path: Path, kind: str | None = None) -> list[dict]:
    """The records of a ``--log-json`` file, in order; only those of ``kind`` if given.

    Raises:
        OSError: the file cannot be read.
        ValueError: a line is not a JSON object (the message names the file and line).
    """
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not a JSON object ({err.msg}).") from err
        if kind is None or record.get("kind") == kind:
            records.append(record)
    return records
