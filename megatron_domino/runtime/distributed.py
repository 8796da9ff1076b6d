"""Start torch.distributed and Megatron-Core's model-parallel state from any launcher.

The same entry point runs in three ways, and :func:`detect_launch` tells them apart from the
environment:

* plain ``python script.py``: one process, world size 1, rendezvous on a free port of
  127.0.0.1 (TP must then be 1);
* ``torchrun``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``
  are set, and the rendezvous goes through ``env://`` so torchrun's agent store is reused;
* SLURM ``srun`` with one task per GPU: ``SLURM_PROCID``, ``SLURM_NTASKS`` and
  ``SLURM_LOCALID`` give the ranks; the master is ``MASTER_ADDR`` if exported, else the first
  host of ``SLURM_NODELIST`` (``scontrol show hostnames``), else ``SLURM_LAUNCH_NODE_IPADDR``;
  the port is ``MASTER_PORT`` or 29500. ``srun torchrun`` is recognised as torchrun.

The backend is NCCL with CUDA and gloo without. On the CPU, :func:`init_distributed` must run
inside :func:`megatron_domino.runtime.cpu_runtime.cpu_runtime`, which is what makes Megatron's RNG
seeding work there::

    with runtime_for_device():
        init_distributed(tensor_model_parallel_size=2, seed=1234)
        try:
            ...
        finally:
            destroy_distributed()
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from megatron_domino.runtime.cpu_runtime import cpu_runtime_active

__all__ = [
    "DEFAULT_MASTER_PORT",
    "DistributedInitError",
    "LaunchEnv",
    "destroy_distributed",
    "detect_launch",
    "export_torchrun_environment",
    "init_distributed",
]

#: Rendezvous port under SLURM when ``MASTER_PORT`` is not exported (torchrun's default).
DEFAULT_MASTER_PORT = 29500


class DistributedInitError(RuntimeError):
    """The launch environment or the requested parallelism cannot be set up; says the fix."""


@dataclass(frozen=True, kw_only=True)
class LaunchEnv:
    """Where this process sits in the job, as read from the launcher's environment."""

    launcher: Literal["single", "torchrun", "slurm"]
    """Which launch style was recognised."""
    rank: int
    """Global rank, 0 .. world_size - 1."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank on this node; selects the GPU (modulo the visible device count)."""
    init_method: str
    """``init_method`` for ``torch.distributed.init_process_group``."""


def _free_local_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _slurm_master_addr(environ: Mapping[str, str]) -> str:
    if "MASTER_ADDR" in environ:
        return environ["MASTER_ADDR"]
    nodelist = environ.get("SLURM_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if nodelist:
        try:
            hosts = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
        except (OSError, subprocess.CalledProcessError):
            hosts = []
        if hosts:
            return hosts[0]
    if "SLURM_LAUNCH_NODE_IPADDR" in environ:
        return environ["SLURM_LAUNCH_NODE_IPADDR"]
    raise DistributedInitError(
        "Under srun, the rendezvous address comes from MASTER_ADDR, `scontrol show hostnames "
        "$SLURM_NODELIST` or SLURM_LAUNCH_NODE_IPADDR, and none is available: export "
        "MASTER_ADDR=<first node's hostname> in the batch script."
    )


def detect_launch(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read rank, world size and rendezvous from the launcher's environment variables.

    Args:
        environ: the environment to read; ``os.environ`` by default.
    """
    environ = os.environ if environ is None else environ
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return LaunchEnv(
            launcher="torchrun",
            rank=int(environ["RANK"]),
            world_size=int(environ["WORLD_SIZE"]),
            local_rank=int(environ.get("LOCAL_RANK", 0)),
            init_method="env://",
        )
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        addr = _slurm_master_addr(environ)
        port = int(environ.get("MASTER_PORT", DEFAULT_MASTER_PORT))
        return LaunchEnv(
            launcher="slurm",
            rank=int(environ["SLURM_PROCID"]),
            world_size=int(environ["SLURM_NTASKS"]),
            local_rank=int(environ.get("SLURM_LOCALID", 0)),
            init_method=f"tcp://{addr}:{port}",
        )
    return LaunchEnv(
        launcher="single",
        rank=0,
        world_size=1,
        local_rank=0,
        init_method=f"tcp://127.0.0.1:{_free_local_port()}",
    )


def export_torchrun_environment(environ: dict[str, str] | None = None) -> LaunchEnv:
    """Set the variables torchrun would set, for a launch that was not torchrun.

    Megatron-LM's ``initialize_megatron`` reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
    rendezvouses through ``env://`` (``MASTER_ADDR``, ``MASTER_PORT``). Under ``srun`` with a
    task per GPU they come from SLURM's variables (see :func:`detect_launch`); a plain
    ``python`` run is rank 0 of 1 on a free local port. Under torchrun nothing changes.

    Args:
        environ: the environment to read and update; ``os.environ`` by default.
    """
    environ = os.environ if environ is None else environ
    launch = detect_launch(environ)
    if launch.launcher != "torchrun":
        address, port = launch.init_method.removeprefix("tcp://").rsplit(":", 1)
        environ.update(
            RANK=str(launch.rank),
            WORLD_SIZE=str(launch.world_size),
            LOCAL_RANK=str(launch.local_rank),
            MASTER_ADDR=address,
            MASTER_PORT=port,
        )
    return launch


def _check_parallel_sizes(world_size: int, tensor_model_parallel_size: int) -> None:
    if tensor_model_parallel_size < 1:
        raise DistributedInitError(
            f"--tensor-model-parallel-size must be >= 1, got {tensor_model_parallel_size}."
        )
    if world_size % tensor_model_parallel_size:
        raise DistributedInitError(
            f"The world size {world_size} is not divisible by --tensor-model-parallel-size "
            f"{tensor_model_parallel_size}: each tensor-parallel group needs "
            f"{tensor_model_parallel_size} processes. Launch a multiple of "
            f"{tensor_model_parallel_size} processes (e.g. `torchrun --nproc-per-node "
            f"{tensor_model_parallel_size} ...`) or pick a tensor-parallel size that divides "
            f"{world_size}."
        )


def _seed_everything(seed: int) -> None:
    """Seed like Megatron-LM's ``_set_random_seed`` with one pipeline stage.

    Python, NumPy and the CPU generator get ``seed`` on every rank (so CPU-initialised weights
    agree across TP ranks); ``model_parallel_cuda_manual_seed`` then sets the device default
    stream to ``seed`` and the tracker's TP stream to ``seed + 2718 + tp_rank``. On the CPU,
    the CPU runtime makes the CPU generator stand in for the device one.
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def init_distributed(
    tensor_model_parallel_size: int,
    seed: int,
    backend: str | None = None,
    *,
    pipeline_model_parallel_size: int = 1,
) -> LaunchEnv:
    """Initialise torch.distributed, Megatron's model-parallel groups and the RNG streams.

    The factor of the world size left after tensor and pipeline parallelism is data
    parallelism.

    Args:
        tensor_model_parallel_size: TP group size; must divide the world size.
        seed: base seed (Megatron-LM's ``--seed``).
        backend: ``"nccl"`` or ``"gloo"``; by default NCCL with CUDA, gloo without.
        pipeline_model_parallel_size: pipeline stages (1 for the training script, which has
            no pipeline schedule; the tests use more).
    Returns:
        The launch environment that was recognised.
    Raises:
        DistributedInitError: already initialised, world size not divisible by TP, NCCL
            without CUDA, or (on the CPU) called outside the CPU runtime.
    """
    if torch.distributed.is_initialized():
        raise DistributedInitError(
            "torch.distributed is already initialised; call destroy_distributed() first."
        )
    cuda = torch.cuda.is_available()
    if not cuda and not cpu_runtime_active():
        raise DistributedInitError(
            "On the CPU, init_distributed must run inside the CPU runtime, which makes "
            "Megatron's RNG tracker work without CUDA: wrap the run in "
            "`with megatron_domino.runtime.cpu_runtime.runtime_for_device(): ...`."
        )
    launch = detect_launch()
    _check_parallel_sizes(launch.world_size, tensor_model_parallel_size)
    backend = backend or ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        raise DistributedInitError("The NCCL backend needs CUDA; use backend='gloo' on the CPU.")
    if cuda:
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
    torch.distributed.init_process_group(
        backend=backend,
        init_method=launch.init_method,
        rank=launch.rank,
        world_size=launch.world_size,
    )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
    )
    _seed_everything(seed)
    return launch


def destroy_distributed() -> None:
    """Tear down Megatron's model-parallel state and the default process group, if any."""
    parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
