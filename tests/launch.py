"""Run ``pretrain_gpt_domino.py`` the way users do, as torchrun runs it, and read its JSON log.

The training tests go through the real command line (the entry script and its ``__main__``
guard, which ``dist_checkpointing``'s spawned writer depends on, Megatron-LM's own argument
parser and ``pretrain()``, one process per rank with torchrun's environment) rather than
calling the loop in-process, so they exercise what a user runs. The ranks are forked from a
server that imported torch, Megatron-Core and ``megatron.training`` once
(:mod:`lab.launch.script_ranks`): about 12 s of imports per rank saved on each
launch. ``torchrun=True`` launches under ``python -m torch.distributed.run`` itself (the smoke
test does, so the torchrun path stays covered; the fault and recipe tests start torchrun or
``srun`` themselves). The CPU flags and the log format are
:mod:`megatron_domino.training.runs`'.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from multiproc import TE_PRELOAD

from lab.launch.ranks import CPU_PRELOAD
from lab.launch.script_ranks import run_script
from megatron_domino.training.runs import cpu_flags, read_records

SCRIPT = Path(__file__).resolve().parent.parent / "pretrain_gpt_domino.py"
#: The same script on Transformer Engine's own Python over the CPU backend
#: (``tests/pretrain_te_cpu.py``): TE boots before Megatron-Core is imported, so its forked
#: ranks come from the TE tests' fork server (:data:`multiproc.TE_PRELOAD`).
TE_CPU_SCRIPT = Path(__file__).resolve().parent / "pretrain_te_cpu.py"

#: Ranks on two cores, started (about 10 s of imports and initialisation), trained a few
#: steps and checkpointed.
TIMEOUT_S = 300

#: A two-layer GPT small enough for a few CPU steps per second, as CPU flags.
TINY_GPT = [
    *cpu_flags(),
    *(
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 "
        "--log-interval 1 --eval-interval 1000 --eval-iters 1"
    ).split(),
]

#: Megatron asserts it with TP > 1 (kernels must start in launch order on a GPU).
ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "OMP_NUM_THREADS": "1"}


def run_pretrain(
    flags: list[str],
    *,
    cwd: Path,
    nproc: int | None = 2,
    expect_success: bool = True,
    torchrun: bool = False,
    script: Path = SCRIPT,
) -> str:
    """Run ``script`` in ``cwd`` on ``nproc`` ranks (forked as in the module docstring, or
    under torchrun with ``torchrun``), or as one plain ``python`` process for ``None``; return
    its output, or fail showing it (unless ``expect_success`` is False: then it must fail, and
    its output is returned)."""
    env = {**os.environ, **ENV}
    if nproc is not None and not torchrun:
        preload = TE_PRELOAD if script == TE_CPU_SCRIPT else CPU_PRELOAD
        result = run_script(
            script, flags, nproc=nproc, cwd=cwd, env=env, timeout_s=TIMEOUT_S, preload=preload
        )
        returncode, output = result.returncode, result.output
    else:
        launcher = [sys.executable]
        if nproc is not None:
            launcher += ["-m", "torch.distributed.run", "--standalone"]
            launcher += ["--nproc-per-node", str(nproc)]
        done = subprocess.run(
            [*launcher, str(script), *flags],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        returncode, output = done.returncode, done.stdout + done.stderr
    if expect_success:
        assert returncode == 0, f"pretrain_gpt_domino.py failed:\n{output[-6000:]}"
    else:
        assert returncode != 0, f"pretrain_gpt_domino.py did not fail:\n{output[-3000:]}"
    return output


def records(log_json: Path, kind: str) -> dict[int, dict]:
    """The ``--log-json`` records of ``kind`` (``train``, ``validation``, ...) by iteration."""
    return {r["iteration"]: r for r in read_records(log_json, kind)}


def train_records(log_json: Path) -> dict[int, dict]:
    """The ``--log-json`` training records, keyed by iteration."""
    return records(log_json, "train")
