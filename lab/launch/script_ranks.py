"""Run a training script on N CPU ranks forked from a preloaded server, as torchrun would run it.

``torchrun --standalone --nproc-per-node N script.py ARGS`` starts N fresh interpreters, and on
two cores each spends about 12 s importing torch, Megatron-Core and ``megatron.training``
before the script does anything: most of a tiny training test's launch. :func:`run_script`
starts the ranks from the fork server of :mod:`lab.launch.ranks` instead, which
imported those once (:data:`~lab.launch.ranks.CPU_PRELOAD`). Each rank is still a
process of its own, forked from that import state, and runs the script the way
torchrun's worker does:

* torchrun's environment for a single-node job: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
  ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_RANK``, ``ROLE_WORLD_SIZE``, ``MASTER_ADDR``,
  ``MASTER_PORT`` and ``TORCHELASTIC_RESTART_COUNT=0``, on top of the caller's environment;
  the process group's store is rank 0's own (torchrun's ``--standalone`` agent store is not
  there, so ``TORCHELASTIC_USE_AGENT_STORE`` is not set);
* the working directory, ``sys.argv = [script, *args]``, ``PYTHONPATH`` entries put first on
  ``sys.path``, one intra-op thread unless ``OMP_NUM_THREADS`` says otherwise, and the
  platform's default start method for the processes it starts;
* the script run as ``__main__`` (``runpy``), so its ``__main__`` guard and the processes it
  spawns (``dist_checkpointing``'s writer re-imports it) behave as under torchrun;
* every rank's stdout and stderr into one file, read back as the launch's output;
* at the end what the interpreter would do: non-daemon threads joined, ``atexit`` handlers run;
* a rank that exits non-zero stops the others (torchrun stops the job on a failed worker), and
  so does the time limit.

Not for what needs torchrun itself (restarts, its signal forwarding, ``srun``): those tests
launch it.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch.multiprocessing as mp

from lab.launch.ranks import CPU_PRELOAD, forking_from, free_port

__all__ = ["ScriptResult", "run_script"]

_POLL_S = 0.2
#: How long the other ranks get to stop after one failed, before they are killed.
_STOP_GRACE_S = 5.0


@dataclass(frozen=True)
class ScriptResult:
    """A finished launch: ``returncode`` (0, or the first failing rank's exit code; ``-9``
    when the time ran out) and ``output`` (every rank's stdout and stderr)."""

    returncode: int
    output: str


def _torchrun_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return dict(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        ROLE_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RESTART_COUNT="0",
    )


def _script_rank(script: str, args: list[str], cwd: str, env: dict[str, str], output: str) -> None:
    """One rank: the script as ``__main__`` with torchrun's environment (module docstring)."""
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    paths = [path for path in env.get("PYTHONPATH", "").split(os.pathsep) if path]
    sys.path[:0] = [str(Path(script).parent), *paths]
    sys.argv = [script, *args]
    # A forkserver child starts with that method as its default; an interpreter with none
    # (the platform's: fork on Linux, what DataLoader workers rely on for local functions).
    multiprocessing.set_start_method(None, force=True)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        _interpreter_exit()


def _interpreter_exit() -> None:
    """What an interpreter does after its main module, which a forked process skips (it ends
    in ``os._exit``): ``threading``'s shutdown (its exit hooks, e.g. thread pools told to stop,
    then the wait for non-daemon threads), the ``atexit`` handlers, the flush."""
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()


def run_script(
    script: Path,
    args: Sequence[str],
    *,
    nproc: int,
    cwd: Path,
    env: Mapping[str, str],
    timeout_s: float,
    preload: Sequence[str] = CPU_PRELOAD,
) -> ScriptResult:
    """Run ``script args`` on ``nproc`` CPU ranks forked from the preloaded server.

    Args:
        script: the training script (run as ``__main__``).
        args: its command line.
        nproc: ranks, as torchrun's ``--nproc-per-node``.
        cwd: the ranks' working directory.
        env: the ranks' environment before torchrun's variables are added.
        timeout_s: wall-clock limit; past it every rank is killed.
        preload: what the ranks' fork server imports (one server per preload,
            :func:`~lab.launch.ranks.forking_from`): a script that needs another import
            state than :data:`~lab.launch.ranks.CPU_PRELOAD` (Transformer Engine booted
            before Megatron-Core) names it.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(CPU_PRELOAD))  # read when the server first starts
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="script-ranks-") as folder:
        output = os.path.join(folder, "output.log")
        Path(output).touch()  # read back even if no rank got to write
        processes = [
            ctx.Process(
                target=_script_rank,
                args=(
                    str(script),
                    list(args),
                    str(cwd),
                    {**env, **_torchrun_env(rank, nproc, port)},
                    output,
                ),
                name=f"rank{rank}",
            )
            for rank in range(nproc)
        ]
        with forking_from(tuple(preload)):
            for process in processes:
                process.start()
        returncode = _wait(processes, time.monotonic() + timeout_s)
        return ScriptResult(returncode, Path(output).read_text(errors="replace"))


def _wait(processes: list, deadline: float) -> int:
    """Wait for every rank; stop the rest when one fails or the time runs out. The launch's
    exit code (see :class:`ScriptResult`)."""
    returncode = 0
    while any(process.is_alive() for process in processes):
        codes = [process.exitcode for process in processes if process.exitcode not in (None, 0)]
        if codes and not returncode:
            returncode = codes[0]
            deadline = min(deadline, time.monotonic() + _STOP_GRACE_S)
            for process in processes:
                if process.is_alive():
                    process.terminate()
        if time.monotonic() > deadline:
            for process in processes:
                if process.is_alive():
                    process.kill()
            returncode = returncode or -9
            break
        time.sleep(_POLL_S)
    for process in processes:
        process.join()
    return returncode or next((p.exitcode for p in processes if p.exitcode != 0), 0)
