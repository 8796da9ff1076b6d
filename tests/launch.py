"""Run ``pretrain_gpt_domino.py`` the way users do, under torchrun, and read its JSON log.

The training tests go through the real command line (torchrun, the entry script and its
``__main__`` guard, which ``dist_checkpointing``'s spawned writer depends on) rather than
calling the loop in-process, so they exercise what a user runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "pretrain_gpt_domino.py"

#: Two ranks on two cores, started, trained a few steps and checkpointed.
TIMEOUT_S = 240

#: A two-layer GPT small enough for a few CPU steps per second.
TINY_GPT = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--micro-batch-size 2 --global-batch-size 4 --log-interval 1"
).split()


def run_pretrain(flags: list[str], *, cwd: Path, nproc: int | None = 2) -> str:
    """Run the script in ``cwd`` on ``nproc`` torchrun ranks, or as one plain ``python``
    process for ``None``; return its output, or fail showing it."""
    launcher = [sys.executable]
    if nproc is not None:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    command = [*launcher, str(SCRIPT), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"pretrain_gpt_domino.py failed:\n{output[-6000:]}"
    return output


def train_records(log_json: Path) -> dict[int, dict]:
    """The ``--log-json`` training records, keyed by iteration."""
    records = [json.loads(line) for line in log_json.read_text().splitlines()]
    return {r["iteration"]: r for r in records if r["kind"] == "train"}
