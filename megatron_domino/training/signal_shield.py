"""The start of the checkpoint writer's helper process: shielded from the job's signals.

Kept apart from :mod:`.loop_runtime`, with the standard library only, because the helper is a
``spawn`` process that imports this module to run :func:`shield_from_job_signals`; importing
torch and Megatron there would add seconds to every rank's start.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["shield_from_job_signals"]

#: ``prctl`` option: the signal a process gets when the thread that started it exits (Linux).
_PR_SET_PDEATHSIG = 1


def shield_from_job_signals(owner_pid: int) -> None:
    """Ignore SIGTERM and SIGINT (the rank that owns this process decides when it stops: it
    shuts it down at exit), and die with that rank (SIGKILL when it exits, however it exits),
    so that ignoring SIGTERM never leaves an orphan behind."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != owner_pid:  # the owner died before prctl took effect
        os._exit(0)
