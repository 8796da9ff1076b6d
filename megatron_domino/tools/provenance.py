"""Where a result came from: commit, versions and machine, recorded beside the numbers.

Every command that writes results (the benchmark, loss parity, the A/B report, the GPU check)
records :func:`provenance` in its JSON and prints :func:`describe` of it with its tables, so
that a number can always be traced to the code and machine that produced it.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

__all__ = ["PACKAGES", "describe", "provenance"]

#: The distributions whose versions are recorded (``None`` when not installed).
PACKAGES = ("megatron-core", "megatron-domino", "transformer-engine")


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    """``git args`` in the megatron-domino checkout the package runs from (``None`` when it is
    not a checkout, e.g. an installed wheel)."""
    import megatron_domino

    package = Path(megatron_domino.__file__).parent
    try:
        done = subprocess.run(
            ["git", "-C", str(package), *args],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def provenance(**extra) -> dict:
    """The record: ``date`` (UTC), ``host``, ``machine``, ``processor``, ``cpus``,
    ``platform``, ``python``, ``commit``, ``uncommitted_changes``, ``torch``, ``cuda``,
    ``gpu`` (the first visible CUDA device's name, else ``None``), ``gpu_count``, and the
    versions of :data:`PACKAGES`; then ``extra`` (e.g. the device a check ran on)."""
    import torch

    status = _git("status", "--porcelain")
    cuda = torch.cuda.is_available()
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "commit": _git("rev-parse", "HEAD"),
        "uncommitted_changes": None if status is None else bool(status),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        **{package: _version(package) for package in PACKAGES},
        **extra,
    }


def describe(record: dict) -> str:
    """One line of a :func:`provenance` record, e.g. ``commit 1a2b3c4 (with uncommitted
    changes), torch 2.13.0, megatron-core 0.19.2, 2 x86_64 CPUs, host h, 2025-01-01T00:00:00+00:00``."""
    commit = record.get("commit") or "unknown"
    changes = " (with uncommitted changes)" if record.get("uncommitted_changes") else ""
    machine = record.get("gpu") or f"{record.get('cpus')} {record.get('machine')} CPUs"
    return (
        f"commit {commit}{changes}, torch {record.get('torch')}, megatron-core "
        f"{record.get('megatron-core')}, {machine}, host {record.get('host')}, "
        f"{record.get('date')}"
    )
