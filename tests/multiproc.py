"""Run a function on N gloo ranks, one spawned process each, and collect what every rank returns.

Megatron-Core keeps its model-parallel state in module globals and torch.distributed allows one
default process group per process, so every rank of a tensor-parallel test needs a process of
its own. :func:`run_on_ranks` spawns them like ``torchrun`` would (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), and in each one enters the CPU runtime,
calls :func:`megatron_domino.distributed.init_distributed`, runs the function and tears the
parallel state down again.

The function and its arguments must be picklable: a module-level function of an importable
module (a test module is fine). Return values travel back by plain pickling, tensors included.
Each rank runs with one intra-op and one inter-op thread, so N ranks share the cores fairly.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
import torch.multiprocessing as mp

#: Long enough for 4 ranks to import Megatron-Core and run a tiny model on 2 busy cores.
DEFAULT_TIMEOUT_S = 180.0
#: How often the parent looks for crashed ranks and the deadline while it waits for results.
_POLL_S = 1.0


class RemoteTraceback(Exception):
    """The traceback of a rank's exception, as text; attached as the re-raised one's cause."""

    def __str__(self) -> str:
        return self.args[0]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    tensor_model_parallel_size: int,
    seed: int,
    fn: Callable[..., Any],
    args: Sequence[Any],
    results: mp.Queue,
) -> None:
    """Body of one rank's process: report ``("ok", rank, pickled result)`` or
    ``("error", rank, (pickled exception or None, traceback text))``."""
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    # Imported here: the parent test process never needs Megatron-Core loaded for this.
    from megatron_domino.cpu_runtime import cpu_runtime
    from megatron_domino.distributed import destroy_distributed, init_distributed

    try:
        with cpu_runtime():
            init_distributed(tensor_model_parallel_size, seed)
            try:
                result = fn(*args)
            finally:
                destroy_distributed()
        results.put(("ok", rank, pickle.dumps(result)))
    except BaseException as exc:  # noqa: B036 - every failure must reach the parent
        try:
            pickled = pickle.dumps(exc)
        except Exception:
            pickled = None
        results.put(("error", rank, (pickled, traceback.format_exc())))


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    tensor_model_parallel_size: int | None = None,
    seed: int = 1234,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` gloo ranks and return the results, by rank.

    Args:
        fn: picklable function run once on every rank, after ``init_distributed``.
        world_size: number of ranks (processes).
        args: picklable positional arguments, the same for every rank.
        tensor_model_parallel_size: TP size; defaults to ``world_size`` (all ranks in one TP
            group).
        seed: the ``seed`` given to ``init_distributed``.
        timeout_s: wall-clock limit for the whole run; past it every rank is killed, so a hung
            collective fails the test instead of hanging CI.
    Returns:
        ``[result of rank 0, result of rank 1, ...]``.
    Raises:
        The first failing rank's exception (or a RuntimeError when it cannot be unpickled),
        with the rank's traceback attached as ``__cause__``. RuntimeError when a rank died
        without reporting (a crash or a kill). TimeoutError when some rank has not finished
        within ``timeout_s``. In every case all ranks are gone when it returns or raises.
    """
    tp = world_size if tensor_model_parallel_size is None else tensor_model_parallel_size
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    processes = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, port, tp, seed, fn, tuple(args), results),
            name=f"rank{rank}",
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    finished = False
    try:
        while len(outputs) < world_size:
            try:
                status, rank, payload = results.get(timeout=_POLL_S)
            except queue.Empty:
                _check_progress(processes, outputs.keys(), deadline, timeout_s)
                continue
            if status == "error":
                _reraise(rank, processes, *payload)
            outputs[rank] = pickle.loads(payload)
        finished = True
    finally:
        # After a failure the other ranks may wait forever in a collective: kill them now.
        for process in processes:
            process.join(timeout=10 if finished else 0)
            if process.is_alive():
                process.kill()
                process.join()
    return [outputs[rank] for rank in range(world_size)]


def _check_progress(
    processes: Sequence[mp.Process], reported: Collection[int], deadline: float, timeout_s: float
) -> None:
    """Raise if a rank died without reporting (a crash, a kill) or the time is up."""
    for rank, process in enumerate(processes):
        # A rank that reports exits with code 0, so a non-zero code means it never will.
        if rank not in reported and process.exitcode not in (None, 0):
            raise RuntimeError(
                f"rank {rank} of {len(processes)} died with exit code {process.exitcode} "
                "without reporting (negative: killed by that signal); all ranks were killed."
            )
    if time.monotonic() > deadline:
        missing = sorted(set(range(len(processes))) - set(reported))
        raise TimeoutError(
            f"ranks {missing} of {len(processes)} did not finish within {timeout_s:.0f} s "
            "(a hung collective?); all ranks were killed."
        )


def _reraise(
    rank: int, processes: Sequence[mp.Process], pickled: bytes | None, remote_tb: str
) -> None:
    world_size = len(processes)
    try:
        exc = pickle.loads(pickled) if pickled is not None else None
    except Exception:
        exc = None
    if not isinstance(exc, BaseException):
        exc = RuntimeError(f"rank {rank} of {world_size} failed (exception not picklable)")
    exc.add_note(f"raised on rank {rank} of {world_size}; its traceback is the cause above")
    # A peer that crashed shows up here only as a broken connection: name the root cause.
    for other, process in enumerate(processes):
        if process.exitcode not in (None, 0):
            exc.add_note(f"rank {other} had died with exit code {process.exitcode}")
    raise exc from RemoteTraceback(f"\n--- rank {rank} ---\n{remote_tb}")
