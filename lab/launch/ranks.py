"""Run one function on N gloo ranks, one process each, on the CPU or sharing one GPU.

Used by the test suite (``tests/multiproc.py``) and by ``python -m lab.gpu_check``.

Megatron-Core keeps its model-parallel state in module globals and torch.distributed allows
one default process group per process, so each tensor-parallel rank needs a process. On a
single GPU both ranks use ``cuda:0``: NCCL refuses two ranks on one device, so the process
group is always gloo (which the probe in :mod:`lab.gpu_check.probe` checks for
device tensors).

On the CPU the ranks are forked from a server that has imported torch, Megatron-Core and the
CPU runtime once (``forkserver`` with :data:`CPU_PRELOAD`): each rank of a fresh interpreter
(``spawn``) spent about 7 s of a tiny test's launch importing them on two cores. A forked rank
is still a process of its own, started from that import state (the server ran nothing beyond
the imports but torch.compile's once-per-process set-up,
:mod:`~lab.launch.compile_warmup`), with its own environment, process group and
Megatron state; the modules it imports afterwards (the test's) are its own, and it compiles
Megatron's kernels itself. On a GPU the ranks are spawned: CUDA must not be initialised before
they set their environment.

The function is named as ``"module:function"`` and imported only in the ranks, so the parent
(e.g. the GPU check, which times GEMMs and writes the report) never imports Megatron-Core. Each rank sets, before
anything touches CUDA:

* ``CUDA_DEVICE_MAX_CONNECTIONS=1``: kernels start in launch order, as Megatron's own overlap
  expects (Megatron-Core warns without it, also on the CPU);
* ``--device cpu``: ``CUDA_VISIBLE_DEVICES=""`` (the CPU runtime refuses to run next to a GPU),
  one intra-op and one inter-op thread per rank so ranks share the cores fairly;
* ``--device cuda``: ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (needed by deterministic cuBLAS,
  which the equivalence part turns on).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import multiprocessing.forkserver
import os
import pickle
import queue
import socket
import sys
import time
import traceback
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import torch.multiprocessing as mp

__all__ = [
    "CPU_PRELOAD",
    "RankFailure",
    "forking_from",
    "free_port",
    "import_target",
    "run_ranks",
]

_POLL_S = 1.0
#: Launches tried when the store's port was taken in between (:func:`run_ranks`).
_PORT_ATTEMPTS = 3
#: What the CPU ranks' fork server imports once (module docstring).
CPU_PRELOAD = (
    "torch",
    "megatron.core",
    "megatron_domino.runtime.cpu_runtime",
    "megatron_domino.runtime.distributed",
    # The training script's imports (megatron.training and Domino's entry point), for
    # lab.launch.script_ranks: the server is one per process, shared by both.
    "megatron.training",
    "megatron_domino.training.pretrain",
    # torch.compile's per-process set-up, which every rank's Megatron kernels need.
    "lab.launch.compile_warmup",
)


#: Fork servers for preloads other than :data:`CPU_PRELOAD` (which uses the standard library's
#: own), one per preload, started on first use and kept for the process's lifetime.
_OTHER_SERVERS: dict[tuple[str, ...], multiprocessing.forkserver.ForkServer] = {}


@contextlib.contextmanager
def forking_from(preload: tuple[str, ...]) -> Iterator[None]:
    """Processes started inside fork from a server that imported ``preload``.

    A process has one standard fork server and its preload is fixed once it runs; ranks that
    need another import state (e.g. the tests' ranks with Transformer Engine booted before
    Megatron-Core, whose ``HAVE_TE`` is decided at import) get a second server. The standard
    library has no public way to pick the server a ``Process`` forks from: its
    ``popen_forkserver`` calls the module function ``forkserver.connect_to_new_process``
    when a process starts, so that one name is pointed at the other server while the ranks
    start, and restored after.

    The server imports ``preload`` with this process's ``sys.path`` (e.g. the test helpers'
    folder): Python 3.12.1's ``forkserver.main`` takes the parent's path but never applies it
    (the standard server's preload is installed packages only), so it is handed over as
    ``PYTHONPATH`` while the server starts.
    """
    if preload == CPU_PRELOAD:
        yield
        return
    server = _OTHER_SERVERS.get(preload)
    if server is None:
        server = _OTHER_SERVERS[preload] = multiprocessing.forkserver.ForkServer()
        server.set_forkserver_preload(list(preload))
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(path for path in sys.path if path)
        try:
            server.ensure_running()
        finally:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved
    standard = multiprocessing.forkserver.connect_to_new_process
    multiprocessing.forkserver.connect_to_new_process = server.connect_to_new_process
    try:
        yield
    finally:
        multiprocessing.forkserver.connect_to_new_process = standard


class RankFailure(RuntimeError):
    """A rank raised, died or did not finish in time; the message carries its traceback."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a process group's store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _device_env(device: str) -> dict[str, str]:
    if device == "cpu":
        return {"CUDA_VISIBLE_DEVICES": "", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def import_target(target: str):
    """The object a ``"module:name"`` string names, imported now (how :func:`run_ranks` takes
    its function, so that only the ranks import it)."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    device: str,
    init: str,
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    seed: int,
    target: str,
    args: tuple,
    results: mp.Queue,
) -> None:
    """One rank: report ``("ok", rank, pickled result)`` or ``("error", rank, traceback)``."""
    os.environ.update(
        _device_env(device),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    # Noise in the progress output: torch deprecates the *_tensor collectives Megatron-Core
    # calls, and Megatron-Core warns per module that Apex and TE are absent (known here).
    warnings.filterwarnings(
        "ignore", message=r".*is deprecated\. Please use", category=FutureWarning
    )
    for noise in (
        "Transformer Engine and Apex are not installed",
        "Apex is not installed",
        "full scope is deprecated",
    ):
        warnings.filterwarnings("ignore", message=noise)
    try:
        import torch
        import torch.distributed as dist

        if device == "cpu":
            torch.set_num_threads(1)
            torch.set_num_interop_threads(1)
        fn = import_target(target)
        if init == "plain":
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=60),
            )
            try:
                result = fn(*args)
            finally:
                dist.destroy_process_group()
        else:
            from megatron_domino.runtime.cpu_runtime import runtime_for_device
            from megatron_domino.runtime.distributed import destroy_distributed, init_distributed

            with runtime_for_device():
                init_distributed(
                    tensor_model_parallel_size,
                    seed,
                    backend="gloo",
                    pipeline_model_parallel_size=pipeline_model_parallel_size,
                )
                try:
                    result = fn(*args)
                finally:
                    destroy_distributed()
        results.put(("ok", rank, pickle.dumps(result)))
    except BaseException:  # noqa: B036 - every failure must reach the parent
        results.put(("error", rank, traceback.format_exc()))


def run_ranks(
    target: str,
    world_size: int,
    *,
    device: Literal["cpu", "cuda"],
    args: Sequence[Any] = (),
    init: Literal["megatron", "plain"] = "megatron",
    tensor_model_parallel_size: int | None = None,
    pipeline_model_parallel_size: int = 1,
    seed: int = 1234,
    timeout_s: float = 180.0,
    preload: Sequence[str] = CPU_PRELOAD,
) -> list[Any]:
    """Run ``target(*args)`` on ``world_size`` gloo ranks; return the results by rank.

    Args:
        target: ``"package.module:function"``; the function and ``args`` must pickle.
        world_size: ranks (processes).
        device: ``cpu`` (the CPU runtime, no GPU visible) or ``cuda`` (every rank on
            ``cuda:0``).
        init: ``megatron``: :func:`~megatron_domino.runtime.distributed.init_distributed` with gloo
            inside :func:`~megatron_domino.runtime.cpu_runtime.runtime_for_device`; ``plain``: only a
            gloo default process group (enough for the collective probe).
        tensor_model_parallel_size: TP size for ``init="megatron"``; defaults to
            ``world_size / pipeline_model_parallel_size``.
        pipeline_model_parallel_size: pipeline stages for ``init="megatron"``.
        seed: Megatron-LM's ``--seed`` for ``init="megatron"``.
        timeout_s: wall-clock limit; past it every rank is killed.
        preload: on the CPU, what the ranks' fork server imports (one server per preload,
            :func:`forking_from`).
    Raises:
        RankFailure: a rank raised (its traceback is in the message), died without reporting,
            or the time ran out. All ranks are gone when this returns or raises.
    """
    pp = pipeline_model_parallel_size
    tp = world_size // pp if tensor_model_parallel_size is None else tensor_model_parallel_size
    ctx = mp.get_context("forkserver" if device == "cpu" else "spawn")
    if device == "cpu":
        ctx.set_forkserver_preload(list(CPU_PRELOAD))  # read when the server first starts
    launch = (ctx, world_size, device, init, tp, pp, seed, target, args, timeout_s, preload)
    for _ in range(_PORT_ATTEMPTS - 1):
        try:
            return _launch(free_port(), *launch)
        except RankFailure as failure:
            # free_port's port can be taken by another process before rank 0 binds it (two
            # pytest workers, a job beside the suite): no rank got past its process group,
            # so launch again on another port.
            if "EADDRINUSE" not in str(failure):
                raise
    return _launch(free_port(), *launch)


def _launch(
    port: int, ctx, world_size, device, init, tp, pp, seed, target, args, timeout_s, preload
) -> list[Any]:
    """One launch of :func:`run_ranks` with its process group's store on ``port``."""
    results = ctx.Queue()
    processes = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, port, device, init, tp, pp, seed, target, tuple(args), results),
            name=f"rank{rank}",
        )
        for rank in range(world_size)
    ]
    with forking_from(tuple(preload)) if device == "cpu" else contextlib.nullcontext():
        for process in processes:
            process.start()
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    finished = False
    try:
        while len(outputs) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:  # also where every rank reports within a poll, past the limit
                _check_progress(processes, outputs, deadline, timeout_s)
            try:
                status, rank, payload = results.get(timeout=min(_POLL_S, max(remaining, 0.0)))
            except queue.Empty:
                _check_progress(processes, outputs, deadline, timeout_s)
                continue
            if status == "error":
                raise RankFailure(f"rank {rank} of {world_size} failed:\n{payload}")
            outputs[rank] = pickle.loads(payload)
        finished = True
    finally:
        for process in processes:
            process.join(timeout=10 if finished else 0)
            if process.is_alive():
                process.kill()
                process.join()
    return [outputs[rank] for rank in range(world_size)]


def _check_progress(
    processes: Sequence[mp.Process], reported: dict, deadline: float, timeout_s: float
) -> None:
    for rank, process in enumerate(processes):
        if rank not in reported and process.exitcode not in (None, 0):
            raise RankFailure(
                f"rank {rank} died with exit code {process.exitcode} without reporting "
                "(negative: killed by that signal)."
            )
    if time.monotonic() > deadline:
        missing = sorted(set(range(len(processes))) - set(reported))
        raise RankFailure(
            f"ranks {missing} did not finish within {timeout_s:.0f} s (a hung collective, or "
            "the time budget is too small); all ranks were killed."
        )
