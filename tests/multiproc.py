"""Run a function on N gloo ranks, one spawned process each, and collect what every rank returns.

Megatron-Core keeps its model-parallel state in module globals and torch.distributed allows one
default process group per process, so every rank of a tensor-parallel test needs a process of
its own. :func:`run_on_ranks` spawns them like ``torchrun`` would (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), and in each one enters the CPU runtime,
calls :func:`megatron_domino.distributed.init_distributed`, runs the function and tears the
parallel state down again.

The function and its arguments must be picklable: a module-level function of an importable
module (a test module is fine). Return values travel back by plain pickling, tensors included.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.multiprocessing as mp

#: Long enough for 4 ranks to import Megatron-Core and run a tiny model on 2 cores.
DEFAULT_TIMEOUT_S = 120.0


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
        with the rank's traceback attached as ``__cause__``. TimeoutError when some rank has
        not finished within ``timeout_s``.
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
            remaining = deadline - time.monotonic()
            try:
                status, rank, payload = results.get(timeout=max(remaining, 0.0))
            except queue.Empty:
                missing = sorted(set(range(world_size)) - outputs.keys())
                raise TimeoutError(
                    f"ranks {missing} of {world_size} did not finish within {timeout_s:.0f} s "
                    "(a hung collective?); all ranks were killed."
                ) from None
            if status == "error":
                _reraise(rank, world_size, *payload)
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


def _reraise(rank: int, world_size: int, pickled: bytes | None, remote_tb: str) -> None:
    try:
        exc = pickle.loads(pickled) if pickled is not None else None
    except Exception:
        exc = None
    if not isinstance(exc, BaseException):
        exc = RuntimeError(f"rank {rank} of {world_size} failed (exception not picklable)")
    exc.add_note(f"raised on rank {rank} of {world_size}; its traceback is the cause above")
    raise exc from RemoteTraceback(f"\n--- rank {rank} ---\n{remote_tb}")
