"""A wire-bound interconnect on one machine: a private network namespace with a shaped loopback.

On plain loopback, gloo's all-reduce is CPU-bound: it competes with the GEMMs for the same two
cores, so no schedule could hide it, and an overlap benchmark would measure the CPU instead.
Inside a private network namespace (``unshare --net``, root only) the loopback can be
rate-limited with a token-bucket filter; gloo then spends its time waiting on the wire, like
a real interconnect, and the cores stay free for compute.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

#: Set in the re-executed process, so it knows it already runs in the private namespace.
INSIDE_ENV = "MEGATRON_DOMINO_BENCH_NETNS"


def inside_private_namespace() -> bool:
    return os.environ.get(INSIDE_ENV) == "1"


def namespace_unavailable_reason() -> str | None:
    """Why a private, shapeable network namespace cannot be made here, or None if it can."""
    if os.geteuid() != 0:
        return "not running as root"
    for tool in ("unshare", "ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`unshare --net` is not permitted ({probe.stderr.strip() or probe.returncode})"
    return None


def reexec_in_private_namespace(argv: list[str]) -> int:
    """Run ``python -m lab.bench argv`` again inside a private network namespace."""
    command = [sys.executable, "-m", "lab.bench", *argv]
    quoted = " ".join(_quote(part) for part in command)
    env = dict(os.environ, **{INSIDE_ENV: "1"})
    # TCP restarts slow start after an idle gap (between steps), which a real interconnect's
    # collectives library does not suffer; switch it off in the private namespace.
    setup = "ip link set lo up && sysctl -qw net.ipv4.tcp_slow_start_after_idle=0"
    return subprocess.run(
        ["unshare", "--net", "sh", "-c", f"{setup} && exec {quoted}"], env=env
    ).returncode


def shape_loopback(rate_mbit: float) -> None:
    """Limit the namespace's loopback to ``rate_mbit`` Mbit/s (both directions share it)."""
    subprocess.run(
        [
            "tc",
            "qdisc",
            "replace",
            "dev",
            "lo",
            "root",
            "tbf",
            "rate",
            f"{rate_mbit:.0f}mbit",
            "burst",
            "256kb",
            "latency",
            "50ms",
        ],
        check=True,
    )


def _quote(part: str) -> str:
    return "'" + part.replace("'", "'\"'\"'") + "'"
