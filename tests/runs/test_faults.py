"""A killed job loses nothing: it restarts from its last complete checkpoint and computes exactly
the losses of an uninterrupted run.

Each scenario is one ``torchrun --max-restarts`` job of ``pretrain_gpt_domino.py`` (gloo,
``--domino``, attention and hidden dropout on, ``--save``/``--load`` on one folder every
:data:`SAVE_INTERVAL` iterations, ``--exit-signal-handler``) that the test hurts while it
trains, watching its ``--log-json`` file and checkpoint folder and signalling its processes
(found with psutil by the ``RANK`` in their environment):

* TP = 2 (:func:`tp2_chain`), three faults in a row, then a resubmission:

  1. ``kill -9`` of rank 1 half-way through an iteration: torchrun restarts the job, which
     loads the latest checkpoint;
  2. ``kill -9`` of rank 0 in the middle of a checkpoint save, after rank 1 wrote its shard and
     before rank 0 wrote its own: Megatron writes ``latest_checkpointed_iteration.txt`` only
     after every shard is on disk, so the half-written folder is never picked; the restart
     loads the previous checkpoint, whose files are unchanged;
  3. SIGTERM to every process of the ranks (the ranks, their DataLoader workers and the
     checkpoint writer's helper), as SLURM signals a job step before its time limit: the
     ranks save at the iteration they are in and exit with status 0; the same command, run
     again, continues from there.

* TP = 2 x DP = 2 with the distributed optimizer (Adam's state sharded over the two replicas,
  :func:`test_tp2_dp2_killed_rank_restarts_exactly_and_sigterm_through_torchrun_saves`):
  ``kill -9`` of a rank of the second data-parallel replica, then SIGTERM to torchrun itself
  and everything under it (the ``srun torchrun`` recipe): torchrun forwards it, and the ranks
  save before torchrun's 30 s grace ends.

The job runs ``tests/pretrain_held.py``, the script with pauses at named points (the start of
an iteration, rank 0's shard write) where each rank waits until the test has struck: a tiny
iteration or save takes 0.1 s, less than a loaded machine may take to notice a log line, and a
fault that lands a step later would test something else. The resubmission and the reference
runs are the plain script.

Every iteration of every attempt must equal the uninterrupted run's (loss, grad norm and
learning rate, bit for bit in fp32): the model, optimizer, scheduler, RNG streams and data
position all came back, and no iteration was repeated from a different state or skipped. At
TP = 2 the uninterrupted run is a separate reference run; at TP = 2 x DP = 2 it is the first
attempt itself, for the two iterations the restart redoes (one run fewer of four ranks).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from launch import ENV, TIMEOUT_S, TINY_GPT, run_pretrain, train_records
from megatron.core.dist_checkpointing.strategies import filesystem_async

from megatron_domino.training.loop_runtime import start_write_results_queue

pytestmark = pytest.mark.slow

ITERATIONS = 8
SAVE_INTERVAL = 3
TRACKER = "latest_checkpointed_iteration.txt"
COMMON = [
    *TINY_GPT,
    "--eval-iters", "0",
    "--lr", "1e-3", "--lr-warmup-iters", "1", "--lr-decay-style", "cosine",
    "--train-iters", str(ITERATIONS),
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200",
    "--attention-dropout", "0.1", "--hidden-dropout", "0.1",
    "--domino",
]  # fmt: skip
#: layout -> (ranks, flags); DP is what the ranks leave over TP. At DP = 2 the distributed
#: optimizer, the GPU recipes' default, shards Adam's state over the two replicas; it resumes on
#: the CPU through the runtime's patches of its load (megatron_domino/training/loop_runtime.py:
#: torch's Adam has no state to check before its first step, and the load lost the step count).
LAYOUTS = {
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "tp2-dp2": (4, ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]),
}
HELD_SCRIPT = Path(__file__).resolve().parents[1] / "pretrain_held.py"
LOADED = re.compile(r"successfully loaded checkpoint from .* at iteration (\d+)")


#: torchrun's agent shares its rendezvous TCPStore with the ranks by default, and that store
#: keeps the previous attempt's keys: a restarted rank reads a dead peer's address and the
#: restart fails in gloo's (or NCCL's) connect (pytorch/pytorch#135712, still so in torch 2.13).
#: The recipes export the same opt-out.
RESTARTABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


class TorchrunJob:
    """``tests/pretrain_held.py`` under ``torchrun --max-restarts``, in the background, held at
    the ``attempt:point`` pairs of ``holds``.

    Its output goes to ``cwd/torchrun.log``; leaving the ``with`` block kills whatever of it
    still runs (the agent's and every rank's process group: torchrun starts each rank in its
    own session).
    """

    def __init__(self, flags, *, cwd: Path, nproc: int, max_restarts: int, holds: list[str]):
        self.log, self.holds, self.nproc = cwd / "torchrun.log", cwd / "holds", nproc
        self.holds.mkdir()
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
            str(HELD_SCRIPT), *map(str, flags),
        ]  # fmt: skip
        held = {"DOMINO_TEST_HOLDS": ",".join(holds), "DOMINO_TEST_HOLD_DIR": str(self.holds)}
        with self.log.open("w") as output:
            self.process = subprocess.Popen(
                command,
                cwd=cwd,
                env={**os.environ, **ENV, **RESTARTABLE, **held},
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.agent = psutil.Process(self.process.pid)

    def __enter__(self) -> TorchrunJob:
        return self

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            for rank in self.ranks().values():
                _kill_group(rank.pid)
            _kill_group(self.process.pid)
            self.process.wait(timeout=60)

    def ranks(self) -> dict[int, psutil.Process]:
        """The current attempt's rank processes (torchrun's children), by ``RANK``."""
        found = {}
        for child in _children(self.agent):
            try:
                environ = child.environ()
            except psutil.Error:
                continue
            if "RANK" in environ:
                found[int(environ["RANK"])] = child
        return found

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, condition, what: str, timeout: float = TIMEOUT_S):
        """Poll ``condition`` every 10 ms until it returns something true; return that."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = condition()
            if found:
                return found
            if self.process.poll() is not None:
                pytest.fail(
                    f"the job ended ({self.process.returncode}) before {what}:\n{self.tail()}"
                )
            time.sleep(0.01)
        pytest.fail(f"no {what} after {timeout} s:\n{self.tail()}")

    def wait_held(self, attempt: int, point: str, ranks: list[int] | None = None) -> None:
        """Until ``ranks`` (default: all) of ``attempt`` wait at ``point`` (pretrain_held.py)."""
        names = [f"attempt{attempt}-{point}-rank{r}" for r in ranks or range(self.nproc)]
        self.wait_for(
            lambda: all((self.holds / name).exists() for name in names),
            f"attempt {attempt} at {point}",
        )

    def release(self, attempt: int, point: str) -> None:
        (self.holds / f"attempt{attempt}-{point}.go").touch()

    def kill_rank(self, rank: int, sig: signal.Signals = signal.SIGKILL) -> None:
        self.ranks()[rank].send_signal(sig)

    def signal_all(self, sig: signal.Signals, *, agent: bool) -> int:
        """Send ``sig`` to every rank and every process under it (as SLURM signals every
        process of a job step), and to torchrun itself if ``agent``; returns how many."""
        processes = [*_children(self.agent, recursive=True), *([self.agent] if agent else [])]
        sent = 0
        for process in processes:
            try:
                process.send_signal(sig)
                sent += 1
            except psutil.NoSuchProcess:
                pass
        return sent

    def finish(self, timeout: float = TIMEOUT_S) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not end within {timeout} s:\n{self.tail()}")

    def tail(self) -> str:
        return self.output()[-6000:]


def _children(process: psutil.Process, recursive: bool = False) -> list[psutil.Process]:
    try:
        return process.children(recursive=recursive)
    except psutil.Error:
        return []


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _lines(log_json: Path) -> list[str]:
    return log_json.read_text().splitlines() if log_json.exists() else []


def _runs(lines: list[str]) -> list[dict[int, dict]]:
    """The training records of each attempt, in order (an attempt starts where the iteration
    number does not increase; a run that resumes exactly continues the numbers, so a separate
    launch is split off by the caller)."""
    runs: list[dict[int, dict]] = []
    previous = None
    for line in lines:
        record = json.loads(line)
        if record["kind"] != "train":
            continue
        if previous is None or record["iteration"] <= previous:
            runs.append({})
        runs[-1][record["iteration"]] = record
        previous = record["iteration"]
    return runs


def _digest(folder: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in folder.iterdir()}


def _tracker(ckpt: Path) -> str | None:
    path = ckpt / TRACKER
    return path.read_text().strip() if path.exists() else None


def _assert_exact(run: dict[int, dict], reference: dict[int, dict], what: str) -> None:
    for iteration, record in run.items():
        for key in ("loss", "grad_norm", "learning_rate"):
            assert record[key] == reference[iteration][key], (what, iteration, key)


def _flags(layout: str, tmp: Path) -> list[str]:
    return [*COMMON, *LAYOUTS[layout][1], "--data-cache-path", str(tmp / "cache")]


def _reference(layout: str, tmp: Path) -> dict[int, dict]:
    """The uninterrupted run: no checkpoint, no signal."""
    log_json = tmp / "reference.jsonl"
    run_pretrain(
        [*_flags(layout, tmp), "--log-json", str(log_json)], cwd=tmp, nproc=LAYOUTS[layout][0]
    )
    records = train_records(log_json)
    assert sorted(records) == list(range(1, ITERATIONS + 1))
    return records


def _checkpointing(layout: str, tmp: Path, save_interval: int = SAVE_INTERVAL) -> list[str]:
    ckpt = tmp / "ckpt"
    return [
        *_flags(layout, tmp),
        "--save", str(ckpt), "--load", str(ckpt), "--save-interval", str(save_interval),
        "--exit-signal-handler", "--log-json", str(tmp / "log.jsonl"),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def tp2_chain(tmp_path_factory):
    """The TP = 2 scenario of the module docstring; returns what the test saw."""
    tmp = tmp_path_factory.mktemp("tp2")
    reference = _reference("tp2", tmp)
    ckpt, log_json = tmp / "ckpt", tmp / "log.jsonl"
    flags = _checkpointing("tp2", tmp)
    shards = ckpt / f"iter_{2 * SAVE_INTERVAL:07d}"
    seen: dict = {"reference": reference}
    holds = ["0:iteration5", "1:write", "2:iteration5"]
    with TorchrunJob(flags, cwd=tmp, nproc=2, max_restarts=2, holds=holds) as job:
        # 1. kill -9 of rank 1 in the middle of iteration 5.
        job.wait_held(0, "iteration5")
        job.kill_rank(1)
        job.release(0, "iteration5")

        # 2. The restart loads iteration 3 and saves at 6: kill -9 of rank 0 once rank 1's
        # shard is on disk and before rank 0 writes its own.
        job.wait_held(1, "write", ranks=[0])
        job.wait_for(lambda: (shards / "__1_0.distcp").is_file(), "rank 1's shard")
        seen["previous_before"] = _digest(ckpt / f"iter_{SAVE_INTERVAL:07d}")
        job.kill_rank(0)
        job.release(1, "write")
        seen["half_written"] = sorted(p.name for p in shards.iterdir())
        seen["tracker_at_kill"] = _tracker(ckpt)

        # 3. The next restart loads iteration 3 again: SIGTERM to every process under the
        # ranks in the middle of iteration 5.
        job.wait_held(2, "iteration5")
        seen["sigterm_sent_to"] = job.signal_all(signal.SIGTERM, agent=False)
        job.release(2, "iteration5")
        seen["returncode"] = job.finish()
        seen["job_output"] = job.output()
    seen["tracker_after_sigterm"] = _tracker(ckpt)
    seen["previous_after"] = _digest(ckpt / f"iter_{SAVE_INTERVAL:07d}")

    # The resubmission: the same command, run again (with the plain script).
    before = _lines(log_json)
    seen["resubmission_output"] = run_pretrain(flags, cwd=tmp, nproc=2)
    seen["runs"] = [*_runs(before), *_runs(_lines(log_json)[len(before) :])]
    seen["tracker_at_end"] = _tracker(ckpt)
    seen["final_save_files"] = sorted(p.name for p in shards.iterdir())
    return seen


def test_a_rank_killed_mid_iteration_restarts_from_the_last_checkpoint_exactly(tp2_chain):
    first, second = tp2_chain["runs"][:2]
    assert sorted(first) == [1, 2, 3, 4]  # killed in iteration 5
    loaded = [int(n) for n in LOADED.findall(tp2_chain["job_output"])]
    assert loaded[0] == SAVE_INTERVAL, tp2_chain["job_output"][-4000:]
    # The restart resumes right after the checkpoint: iteration 4, from the checkpoint's state.
    assert min(second) == SAVE_INTERVAL + 1
    _assert_exact(first, tp2_chain["reference"], "before the kill")
    _assert_exact(second, tp2_chain["reference"], "after the restart")


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_in_charge(tp2_chain):
    # At the kill: rank 1's shard on disk, rank 0's not, no metadata, tracker still at 3.
    assert tp2_chain["half_written"] == ["__1_0.distcp"]
    assert tp2_chain["tracker_at_kill"] == str(SAVE_INTERVAL)
    loaded = [int(n) for n in LOADED.findall(tp2_chain["job_output"])]
    assert loaded == [SAVE_INTERVAL, SAVE_INTERVAL], "the half-written iteration 6 was loaded"
    assert tp2_chain["previous_after"] == tp2_chain["previous_before"]
    third = tp2_chain["runs"][2]
    assert min(third) == SAVE_INTERVAL + 1
    _assert_exact(third, tp2_chain["reference"], "after the mid-save kill")
    # Saved again later over the half-written folder (Megatron overwrites it), complete.
    assert {".metadata", "metadata.json", "__0_0.distcp", "__1_0.distcp"} <= set(
        tp2_chain["final_save_files"]
    )


def test_sigterm_saves_exits_cleanly_and_a_resubmission_continues_exactly(tp2_chain):
    output = tp2_chain["job_output"]
    assert tp2_chain["returncode"] == 0, output[-4000:]
    assert tp2_chain["sigterm_sent_to"] > 2  # the ranks and processes under them
    assert "exiting program after receiving SIGTERM" in output
    third, fourth = tp2_chain["runs"][2:]
    stopped_at = int(tp2_chain["tracker_after_sigterm"])
    assert stopped_at == max(third) == 5  # saved at the end of the iteration it was in
    resubmission = tp2_chain["resubmission_output"]
    assert [int(n) for n in LOADED.findall(resubmission)] == [stopped_at]
    assert sorted(fourth) == list(range(stopped_at + 1, ITERATIONS + 1))
    _assert_exact(fourth, tp2_chain["reference"], "after the resubmission")
    assert tp2_chain["tracker_at_end"] == str(ITERATIONS)


def test_tp2_dp2_killed_rank_restarts_exactly_and_sigterm_through_torchrun_saves(tmp_path):
    """Saving every 4 iterations and killed in iteration 7, the job redoes 5 and 6 from the
    checkpoint of iteration 4: they must equal the first attempt's 5 and 6, computed without
    interruption (the loss of 6 also depends on the optimizer state restored at 4), so this
    layout needs no separate reference run."""
    interval = 4
    ckpt, log_json = tmp_path / "ckpt", tmp_path / "log.jsonl"
    flags = _checkpointing("tp2-dp2", tmp_path, save_interval=interval)
    holds = ["0:iteration7", "1:iteration6"]
    with TorchrunJob(flags, cwd=tmp_path, nproc=4, max_restarts=1, holds=holds) as job:
        # Rank 2: TP rank 0 of the second data-parallel replica, which reads its own data.
        job.wait_held(0, "iteration7")
        job.kill_rank(2)
        job.release(0, "iteration7")
        # SIGTERM to torchrun and everything under it, in the middle of iteration 6.
        job.wait_held(1, "iteration6")
        job.signal_all(signal.SIGTERM, agent=True)
        job.release(1, "iteration6")
        job.finish()  # torchrun's own status reports the signal; the ranks' is checked below
        output = job.output()
    first, second = _runs(_lines(log_json))
    assert sorted(first) == list(range(1, interval + 3))  # killed in iteration 7
    assert [int(n) for n in LOADED.findall(output)] == [interval], output[-4000:]
    assert sorted(second) == [interval + 1, interval + 2]
    _assert_exact(second, first, "redone after the restart")
    assert "exiting program after receiving SIGTERM" in output
    assert _tracker(ckpt) == str(interval + 2)
    assert {".metadata", "metadata.json"} <= {
        p.name for p in (ckpt / f"iter_{interval + 2:07d}").iterdir()
    }


def test_the_checkpoint_writers_helper_outlives_sigterm_but_not_its_rank(tmp_path):
    """SLURM's SIGTERM reaches the writer's manager process too: it must still take results
    (the rank saves because of that signal), and must not outlive a rank killed with -9."""
    previous, filesystem_async._results_queue = filesystem_async._results_queue, None
    try:
        start_write_results_queue()
        queue = filesystem_async._results_queue
        helper = psutil.Process(queue._manager._process.pid)
        helper.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert helper.is_running() and helper.status() != psutil.STATUS_ZOMBIE
        queue.put({"rank": 0})
        assert queue.get(timeout=30) == {"rank": 0}
        queue._manager.shutdown()
    finally:
        filesystem_async._results_queue = previous

    # A rank stand-in, forked (the modules are loaded already): starts its own queue, says
    # its helper's pid, waits to be killed.
    fork = multiprocessing.get_context("fork")
    receiver, sender = fork.Pipe(duplex=False)
    owner = fork.Process(target=_own_a_queue, args=(sender,))
    owner.start()
    helper = psutil.Process(receiver.recv())
    owner.kill()
    owner.join()
    helper.wait(timeout=30)  # gone with its owner (psutil raises TimeoutExpired otherwise)


def _own_a_queue(sender) -> None:
    filesystem_async._results_queue = None
    start_write_results_queue()
    sender.send(filesystem_async._results_queue._manager._process.pid)
    time.sleep(600)
