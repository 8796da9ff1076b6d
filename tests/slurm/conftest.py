"""The SLURM tier: a real one-node Slurm (``scripts/slurm_cluster.sh``) started for the
session, and jobs submitted to it with ``sbatch --wait`` as users submit the recipes.

``make test-slurm`` runs it (``.ci/run`` after ``make test``, which leaves this folder out).
Slurm needs root to start its daemons and, where it is missing, to install it (apt-get): where
it cannot be started the tier is skipped with the reason, except under CI (``CI=true``), where
that is a failure, so that a CI run never passes without submitting a job.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = REPO / "scripts" / "slurm_cluster.sh"
#: GPUs the test node declares: more than any job asks for (2), as on a real 8-GPU node.
NODE_GPUS = 8
#: Job states after which nothing more happens to a job (a requeued job is REQUEUED, then
#: PENDING, and never passes through these).
FINAL_STATES = {
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
    "PREEMPTED", "TIMEOUT",
}  # fmt: skip
#: Seconds a requeued job waits before it starts again, instead of Slurm's two minutes. Not
#: 0: the node's slurmd refuses a job credential issued in the same second its previous run's
#: was revoked ("Killing non-startable batch job: Job credential revoked", seen here), and the
#: job then fails instead of restarting.
REQUEUE_HOLD = 5


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _cannot_start(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"the SLURM tier must run in CI, but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_conf(tmp_path_factory) -> Path:
    """A running one-node Slurm with :data:`NODE_GPUS` GPUs: its ``slurm.conf``. Stopped (by
    PID) when the session ends."""
    if os.geteuid() != 0:
        _cannot_start("the test Slurm's daemons run as root, and this is not root")
    directory = tmp_path_factory.mktemp("slurm")
    # Ports of its own, so that another Slurm on this machine (a developer's) does not answer.
    ports = {"SLURMCTLD_PORT": str(_free_port()), "SLURMD_PORT": str(_free_port())}
    started = subprocess.run(
        [str(CLUSTER_SCRIPT), "start", str(directory), str(NODE_GPUS)],
        env={**os.environ, **ports},
        capture_output=True,
        text=True,
        timeout=600,  # apt-get included
    )
    if started.returncode != 0:
        subprocess.run([str(CLUSTER_SCRIPT), "stop", str(directory)], check=False)
        _cannot_start(f"Slurm could not be started: {started.stderr.strip()}")
    yield directory / "slurm.conf"
    subprocess.run([str(CLUSTER_SCRIPT), "stop", str(directory)], check=True, timeout=60)


@dataclass(frozen=True)
class Job:
    """A finished job: its id, exit status (its batch script's, as ``sbatch --wait``
    reports it), wall time from submission to its end, and what ``scontrol show job`` says
    of it then."""

    job_id: str
    status: int
    seconds: float
    info: dict[str, str]
    output: str

    @property
    def completed(self) -> bool:
        """Ran and exited 0: a job Slurm could not start (an --output it cannot open) ends
        FAILED with exit code 0."""
        return self.status == 0 and self.info.get("JobState") == "COMPLETED"


class Slurm:
    """sbatch, scontrol and scancel against the session's Slurm."""

    def __init__(self, conf: Path):
        self.env = {**os.environ, "SLURM_CONF": str(conf)}

    def scontrol(self, *args: str) -> str:
        return subprocess.run(
            ["scontrol", *args], env=self.env, capture_output=True, text=True, check=True
        ).stdout

    def scancel(self, *args: str) -> None:
        subprocess.run(["scancel", *args], env=self.env, check=True)

    def job_info(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o``'s ``Key=Value`` words (values without spaces suffice here)."""
        words = self.scontrol("show", "job", "-o", job_id).split()
        return dict(word.split("=", 1) for word in words if "=" in word)

    def submit(
        self,
        script: str,
        *,
        knobs: dict[str, str],
        sbatch_args: tuple[str, ...] = (),
        output: Path,
        timeout: float,
        while_running: Callable[[str, dict[str, str]], None] | None = None,
        on_requeue: tuple[str, ...] = (),
    ) -> Job:
        """``sbatch --wait`` an examples/ script from the checkout's root with ``knobs`` in the
        environment (sbatch's default --export=ALL takes them to the job), as a user submits
        it. Every second until it ends: a job requeued by its script gets its requeue hold
        (BeginTime, about 2 minutes) cut to :data:`REQUEUE_HOLD` seconds, once per restart
        (StartTime, with the ``on_requeue`` settings in the same update), then
        ``while_running(job_id, info)`` runs. Past ``timeout`` the job is cancelled and the
        test fails with the end of its output.

        The job's end is read here too, from ``scontrol``: ``sbatch --wait`` polls with a
        doubling interval (its returns came at 10, 42 and 106 s here, whenever the job had
        ended), which would make every job look as long as the next step. Once the job is in
        a final state the waiting sbatch is stopped, and the status is the job's exit code."""
        env = {**self.env, **knobs}
        command = ["sbatch", "--wait", "--parsable", f"--output={output}", *sbatch_args]
        started = time.monotonic()
        waiting = subprocess.Popen(
            [*command, str(Path("examples") / script)],  # an absolute path stays one
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        job_id = waiting.stdout.readline().strip().split(";")[0]
        assert job_id.isdigit(), waiting.stderr.read()
        holds_cut = set()
        while waiting.poll() is None:
            info = self.job_info(job_id)
            if info.get("JobState") in FINAL_STATES:
                waiting.terminate()
                waiting.wait(timeout=60)
                break
            if time.monotonic() - started > timeout:
                subprocess.run(["scancel", job_id], env=self.env, check=False)
                waiting.wait(timeout=60)
                tail = output.read_text()[-3000:] if output.exists() else "(no output)"
                pytest.fail(f"job {job_id} ({script}) ran past {timeout} s:\n{tail}")
            restart = info.get("Restarts")
            held = info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime"
            if held and restart not in holds_cut:
                holds_cut.add(restart)
                start = f"StartTime=now+{REQUEUE_HOLD}"
                self.scontrol("update", f"JobId={job_id}", start, *on_requeue)
            if while_running is not None:
                while_running(job_id, info)
            time.sleep(1)
        seconds = time.monotonic() - started
        info = self.job_info(job_id)
        return Job(
            job_id=job_id,
            status=int(info["ExitCode"].split(":")[0]),
            seconds=seconds,
            info=info,
            output=output.read_text() if output.exists() else "",
        )


@pytest.fixture(scope="session")
def slurm(slurm_conf) -> Slurm:
    return Slurm(slurm_conf)
