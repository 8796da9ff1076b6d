"""The recipes in examples/ submitted with ``sbatch`` to a real Slurm, as users launch them:
rank mapping, both launch styles with and without ``--domino``, the A/B report, and the
requeue machinery against Slurm's own signals, requeue and restart count.

The node (``conftest.NODE_GPUS`` = 8 GPUs, device files standing in for them) has more GPUs than
any job asks for (2), so every job here also runs under the recipes' ``#SBATCH --exclusive``,
which hands a job the whole node. The runs are CPU runs (``CPU=1``: gloo, Megatron-Core's own
layers) of the ``tiny`` model at TP = 2, with mock data and dropout off, so that every launch of
the same knobs computes the same losses bit for bit.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

import pytest
from conftest import NODE_GPUS

#: Iterations of the A/B jobs: enough for the report's medians (10 % warm-up left out).
AB_ITERS = 100
#: Iterations of the jobs that are stopped, requeued and resumed, and of the uninterrupted run
#: they are held to: long enough (about 80 s of training here, 0.08-0.1 s per iteration) that
#: the time-limit signal, which Slurm sends at its next check, up to 30 s after the limit is
#: cut, lands while it trains.
TRAIN_ITERS = 800
KNOBS = {
    "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    "CPU": "1",
    "MODEL": "tiny",
    "MOCK": "1",
    "TP": "2",
    "BF16": "0",
    "TRAIN_ITERS": str(TRAIN_ITERS),
    "LOG_INTERVAL": "10",
    "EVAL_ITERS": "0",
}
#: The GPUs each job asks for: fewer than the node has.
ASKED = ("--gpus-per-node=2",)
#: Seconds a job may take here (2 shared cores) before it is cancelled and the test fails.
JOB_TIMEOUT = 420


def losses(log_json: Path) -> dict[int, float]:
    """Training loss per iteration from a run's --log-json (every iteration, unaveraged)."""
    records = [json.loads(line) for line in log_json.read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    by_iteration = {r["iteration"]: r["loss"] for r in train}
    assert len(by_iteration) == len(train), "an iteration was logged twice"
    return by_iteration


def job_knobs(tmp_path: Path, **more: str) -> dict[str, str]:
    return {
        **KNOBS,
        "RUN_DIR": str(tmp_path / "run"),
        "DATA_CACHE_PATH": str(tmp_path / "cache"),
        **more,
    }


def report(job, what: str) -> None:
    """One line per job in pytest's output (-rP shows it; the closing notes quote it)."""
    print(f"job {job.job_id} ({what}): status {job.status}, {job.seconds:.0f} s, "
          f"restarts {job.info.get('Restarts')}, state {job.info.get('JobState')}")  # fmt: skip


# --- GPUs asked for, GPUs had -------------------------------------------------------------


def test_an_exclusive_job_is_handed_every_gpu_of_the_node(slurm, tmp_path):
    """The premise of the next test: with --exclusive, as the recipes' headers ask, a job
    that asked for 2 GPUs has all of the node's (Slurm: an exclusive job "is allocated all
    CPUs and GRES on all nodes")."""
    script = tmp_path / "show.sh"
    script.write_text(
        "#!/bin/bash\necho ON_NODE=$SLURM_GPUS_ON_NODE PER_NODE=$SLURM_GPUS_PER_NODE\n"
    )
    job = slurm.submit(
        str(script), knobs={}, sbatch_args=("--exclusive", *ASKED), output=tmp_path / "out",
        timeout=60,
    )  # fmt: skip
    assert job.completed and f"ON_NODE={NODE_GPUS} PER_NODE=2" in job.output, job.output


@pytest.mark.parametrize(
    ("script", "launcher"),
    [
        ("pretrain_gpt_srun.sh", "--ntasks-per-node=2"),
        ("pretrain_gpt_torchrun.sh", "--nproc-per-node 2"),
        ("ab_compare.sh", "--ntasks-per-node=2"),
    ],
)
def test_ranks_per_node_are_the_gpus_the_job_asked_for(slurm, tmp_path, script, launcher):
    """Submitted with --gpus-per-node=2 to the 8-GPU node: 2 ranks, one per GPU asked for.
    The recipes used to take the 8 GPUs --exclusive handed the job: 8 ranks (DP = 4) on a
    job that asked for 2 GPUs."""
    job = slurm.submit(
        script, knobs=job_knobs(tmp_path, DRY_RUN="1"), sbatch_args=ASKED,
        output=tmp_path / "out", timeout=60,
    )  # fmt: skip
    assert job.completed, job.output
    assert "1 node(s) x 2 ranks, TP=2, PP=1, DP=1" in job.output
    assert launcher in job.output
    if script == "ab_compare.sh":
        assert "--gpus 2 " in job.output
    # More ranks than the node gave the job GPUs would share GPUs: refused, naming both.
    refused = slurm.submit(
        script, knobs=job_knobs(tmp_path, DRY_RUN="1", GPUS_PER_NODE=str(2 * NODE_GPUS)),
        sbatch_args=ASKED, output=tmp_path / "refused", timeout=60,
    )  # fmt: skip
    assert refused.status == 1
    assert f"GPUS_PER_NODE={2 * NODE_GPUS} ranks per node, but the job has {NODE_GPUS}" in (
        refused.output
    )


# --- Training jobs ------------------------------------------------------------------------


def test_ab_compare_in_both_launch_styles_writes_its_table_and_equal_losses(slurm, tmp_path):
    """ab_compare.sh under srun per rank and under srun torchrun per node, each arm without
    and with --domino: the same losses (bit for bit between the styles; Domino's within float
    rounding of stock's, its chunks sum in another order), and the report's table.md and
    ab.json, also from Megatron-LM's own iteration lines."""
    for style in ("srun", "torchrun"):
        ab = tmp_path / style
        ab.mkdir()  # for sbatch's --output file
        knobs = job_knobs(ab, AB_DIR=str(ab / "ab"), LAUNCHER=style, TRAIN_ITERS=str(AB_ITERS))
        job = slurm.submit(
            "ab_compare.sh", knobs=knobs, sbatch_args=ASKED, output=ab / "out",
            timeout=JOB_TIMEOUT,
        )  # fmt: skip
        report(job, f"ab_compare.sh, {style}")
        assert job.completed, job.output[-3000:]
        table = (ab / "ab" / "table.md").read_text()
        assert table.startswith("| arm | system | GPUs | precision | model |")
        assert "| baseline |" in table and "| domino |" in table and "| p=2 k=1 |" in table
        result = json.loads((ab / "ab" / "ab.json").read_text())
        assert set(result["arms"]) == {"baseline", "domino"}
        assert result["loss_parity"]["common_iterations"] == AB_ITERS
        assert result["loss_parity"]["max_abs_diff"] < 1e-4, style
        assert result["meta"]["launcher"] == style
        command = result["arms"]["domino"]["command"]
        assert command.startswith("srun ") and (("torchrun" in command) == (style == "torchrun"))
    # The report reads Megatron-LM's own iteration lines too (averaged over LOG_INTERVAL = 10),
    # so a change of their format shows up here.
    from megatron_domino.tools import ab_report

    srun_ab, torchrun_ab = tmp_path / "srun" / "ab", tmp_path / "torchrun" / "ab"
    text = tmp_path / "from-train-log"
    arms = ["--baseline", str(srun_ab / "baseline" / "train.log")]
    arms += ["--domino", str(srun_ab / "domino" / "train.log")]
    assert ab_report.main([*arms, "--gpus", "2", "--out-dir", str(text)]) == 0
    from_text = json.loads((text / "ab.json").read_text())
    assert from_text["loss_parity"]["final_iteration"] == AB_ITERS
    assert from_text["loss_parity"]["max_abs_diff"] < 1e-4
    for arm in ("baseline", "domino"):
        srun_losses = losses(srun_ab / arm / "log.jsonl")
        assert list(srun_losses) == list(range(1, AB_ITERS + 1))
        assert losses(torchrun_ab / arm / "log.jsonl") == srun_losses, arm


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory) -> dict[int, float]:
    """The losses of pretrain_gpt_srun.sh with --domino run to the end in one go: what the
    stopped, requeued and resumed jobs below must compute."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    job = slurm.submit(
        "pretrain_gpt_srun.sh", knobs=job_knobs(tmp_path, DOMINO="1"), sbatch_args=ASKED,
        output=tmp_path / "out", timeout=JOB_TIMEOUT,
    )  # fmt: skip
    report(job, "pretrain_gpt_srun.sh, uninterrupted")
    assert job.completed and job.info["Restarts"] == "0", job.output[-3000:]
    return losses(tmp_path / "run" / "log.jsonl")


def _resumed(train_log: str) -> list[tuple[int, int]]:
    """(iteration stopped at, status) of every requeue the script logged."""
    found = re.findall(
        r"# training stopped at iteration (\d+) of \d+ \(status (\d+)\); requeueing", train_log
    )
    return [(int(i), int(s)) for i, s in found]


def _check_resumed_run(tmp_path: Path, uninterrupted: dict[int, float], job) -> int:
    """The requeued job's run: requeued once, resumed from the iteration it saved on the
    signal, trained to the end, every iteration logged once, the losses of the uninterrupted
    --domino run. Returns the iteration it saved at."""
    assert job.completed, job.output[-3000:]
    assert job.info["Restarts"] == "1"
    train_log = (tmp_path / "run" / "train.log").read_text()
    [(saved, status)] = _resumed(train_log)
    assert 0 < saved < TRAIN_ITERS
    # Megatron-LM's own line when it loads the checkpoint the signal made it save.
    loaded = rf"successfully loaded checkpoint from \S+ \[.*\] at iteration {saved}\b"
    assert re.search(loaded, train_log), train_log[-3000:]
    assert f"iteration {TRAIN_ITERS:8d}/{TRAIN_ITERS:8d}" in train_log
    checkpoints = tmp_path / "run" / "checkpoints"
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == str(
        TRAIN_ITERS
    )
    resumed = losses(tmp_path / "run" / "log.jsonl")
    assert list(resumed) == list(range(1, TRAIN_ITERS + 1))
    assert resumed == uninterrupted
    print(
        f"saved at iteration {saved} (status {status}), resumed from {saved}, final {TRAIN_ITERS}"
    )
    return saved


def _trained_iterations(tmp_path: Path) -> int:
    log = tmp_path / "run" / "log.jsonl"
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_sigterm_before_the_time_limit_saves_requeues_and_resumes(slurm, tmp_path, uninterrupted):
    """srun style: SIGTERM to the job's ranks mid-run (what --signal=TERM@300 sends five
    minutes before the limit; here scancel --signal=TERM): every rank saves and exits, the
    script requeues the job, Slurm restarts it, it resumes and finishes."""
    signalled = []

    def signal_mid_run(job_id, info):
        if not signalled and info["JobState"] == "RUNNING" and _trained_iterations(tmp_path) >= 20:
            signalled.append(_trained_iterations(tmp_path))
            slurm.scancel("--signal=TERM", job_id)

    job = slurm.submit(
        "pretrain_gpt_srun.sh", knobs=job_knobs(tmp_path, DOMINO="1"), sbatch_args=ASKED,
        output=tmp_path / "out", timeout=JOB_TIMEOUT, while_running=signal_mid_run,
    )  # fmt: skip
    report(job, "pretrain_gpt_srun.sh, SIGTERM")
    assert signalled, "the run ended before it was signalled"
    assert _check_resumed_run(tmp_path, uninterrupted, job) >= signalled[0]


def _seconds(run_time: str) -> int:
    """Slurm's [D-]HH:MM:SS as seconds."""
    days, _, clock = run_time.rpartition("-")
    hours, minutes, seconds = (int(part) for part in clock.split(":"))
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds


def test_the_time_limit_signal_saves_requeues_and_resumes(slurm, tmp_path, uninterrupted):
    """torchrun style, a real time limit: submitted with --time=30 --signal=TERM@150; once it
    trains (its first iteration logged: the ranks' signal handler is in place), its limit is
    cut (scontrol update TimeLimit) to 2-3 minutes from now, so Slurm itself sends the signal
    at its next time-limit check (every 30 s; it sends it up to 30 s early) and the kill is
    still 90 s or more away. Torchrun passes the signal to its ranks, they save, the script
    requeues the job (with its limit back at 30 minutes, so the restart runs to the end)."""
    cut = []

    def cut_the_time_limit(job_id, info):
        if not cut and info["JobState"] == "RUNNING" and _trained_iterations(tmp_path) >= 1:
            minutes = math.ceil(_seconds(info["RunTime"]) / 60) + 2
            cut.append(minutes)
            slurm.scontrol("update", f"JobId={job_id}", f"TimeLimit={minutes}")

    job = slurm.submit(
        "pretrain_gpt_torchrun.sh", knobs=job_knobs(tmp_path, DOMINO="1"),
        sbatch_args=(*ASKED, "--time=30", "--signal=TERM@150"), output=tmp_path / "out",
        timeout=JOB_TIMEOUT, while_running=cut_the_time_limit, on_requeue=("TimeLimit=30",),
    )  # fmt: skip
    report(job, "pretrain_gpt_torchrun.sh, time limit")
    assert cut, "the run ended before its time limit was cut"
    _check_resumed_run(tmp_path, uninterrupted, job)


@pytest.mark.parametrize("script", ["pretrain_gpt_srun.sh", "pretrain_gpt_torchrun.sh"])
def test_a_refused_command_line_is_not_requeued_and_keeps_its_status(slurm, tmp_path, script):
    """Without CPU=1 on this GPU-less node the script refuses NCCL (status 2) and says which
    knob to set; the job fails with that status instead of being requeued MAX_REQUEUES times
    (issue 29: 4 runs over 12 minutes before FAILED). Under srun the status reaching the
    script can be 143 (the rank srun killed after the other refused), under torchrun 1 (after
    its MAX_RESTARTS restarts, each refused again): the job's status is 2 all the same."""
    knobs = job_knobs(tmp_path)
    del knobs["CPU"]
    job = slurm.submit(
        script, knobs=knobs, sbatch_args=ASKED, output=tmp_path / "out", timeout=JOB_TIMEOUT
    )
    report(job, f"{script}, refused")
    assert job.status == 2 and job.info["JobState"] == "FAILED", job.output[-3000:]
    assert job.info["Restarts"] == "0" and job.info["ExitCode"] == "2:0"
    assert "no CUDA device here" in job.output and "CPU=1" in job.output
    assert "not requeued: the command line or an input was refused" in job.output


# --- what an H100 job runs, as far as the CPU allows ------------------------------------

#: Iterations of the TE jobs: TE's Python over the CPU backend is slower per iteration than
#: Megatron's local layers, and the signal lands after :data:`TE_SIGNAL_AT` of them.
TE_ITERS, TE_SIGNAL_AT = 120, 20
#: The recipes' GPU configuration: Transformer Engine's layers (its own Python, booted on the
#: CPU by tests/pretrain_te_cpu.py), sequence parallelism with the norms-apart spec, bf16 with
#: FP8 (FP8_RECIPE), micro-batch 1 with the sequence split, the distributed optimizer (the
#: recipes' default, CPU=1 too); CPU=1 for gloo and the CPU flags.
H100_KNOBS = {
    "TRANSFORMER_IMPL": "transformer_engine",
    "BF16": "1",
    "FP8_FORMAT": "hybrid",
    "FP8_RECIPE": "tensorwise",
    "MICRO_BATCH_SIZE": "1",
    "DOMINO": "1",
    "DOMINO_SPLIT": "sequence",
    "DOMINO_CHUNKS": "2",
    "TRAIN_ITERS": str(TE_ITERS),
    "LOG_INTERVAL": "5",
}


def _h100_knobs(tmp_path: Path) -> dict[str, str]:
    from te_cpu import te_home

    repo = Path(__file__).resolve().parents[2]
    return job_knobs(
        tmp_path, **H100_KNOBS, TRAIN_SCRIPT=str(repo / "tests" / "pretrain_te_cpu.py"),
        PYTHONPATH=str(repo), MEGATRON_DOMINO_TE_HOME=str(te_home()),
    )  # fmt: skip


def test_the_h100_configuration_is_preempted_requeued_and_resumed(slurm, tmp_path):
    """srun style, the GPU recipe's own defaults on TE's layers: an uninterrupted job, then the
    same knobs SIGTERMed mid-run (scancel --signal=TERM): every rank saves (the distributed
    optimizer's sharded state included), the script requeues the job, it resumes and computes
    the uninterrupted job's losses bit for bit."""
    reference_dir, stopped_dir = tmp_path / "reference", tmp_path / "stopped"
    reference_dir.mkdir()
    stopped_dir.mkdir()
    job = slurm.submit(
        "pretrain_gpt_srun.sh", knobs=_h100_knobs(reference_dir), sbatch_args=ASKED,
        output=reference_dir / "out", timeout=JOB_TIMEOUT,
    )  # fmt: skip
    report(job, "pretrain_gpt_srun.sh, TE + SP + FP8 tensorwise, uninterrupted")
    assert job.completed and job.info["Restarts"] == "0", job.output[-3000:]
    train_log = (reference_dir / "run" / "train.log").read_text()
    for flag in ("--transformer-impl transformer_engine", "--sequence-parallel", "--fp8-recipe tensorwise",
                 "--use-distributed-optimizer", "te_norms_apart_block_spec", "--domino-split sequence"):  # fmt: skip
        assert flag in train_log, flag
    uninterrupted = losses(reference_dir / "run" / "log.jsonl")
    assert list(uninterrupted) == list(range(1, TE_ITERS + 1))
    signalled = []

    def signal_mid_run(job_id, info):
        trained = _trained_iterations(stopped_dir)
        if not signalled and info["JobState"] == "RUNNING" and trained >= TE_SIGNAL_AT:
            signalled.append(trained)
            slurm.scancel("--signal=TERM", job_id)

    job = slurm.submit(
        "pretrain_gpt_srun.sh", knobs=_h100_knobs(stopped_dir), sbatch_args=ASKED,
        output=stopped_dir / "out", timeout=JOB_TIMEOUT, while_running=signal_mid_run,
    )  # fmt: skip
    report(job, "pretrain_gpt_srun.sh, TE + SP + FP8 tensorwise, SIGTERM")
    assert signalled, "the run ended before it was signalled"
    assert job.completed and job.info["Restarts"] == "1", job.output[-3000:]
    [(saved, _)] = _resumed((stopped_dir / "run" / "train.log").read_text())
    assert TE_SIGNAL_AT <= saved < TE_ITERS
    resumed = losses(stopped_dir / "run" / "log.jsonl")
    assert list(resumed) == list(range(1, TE_ITERS + 1))
    assert resumed == uninterrupted
    print(f"TE job saved at iteration {saved}, resumed, final {TE_ITERS}")


# --- Megatron-Core's HybridModel (MODEL_CLASS=hybrid) ------------------------------------


def test_a_hybrid_model_job_trains_with_domino(slurm, tmp_path):
    """srun style, MODEL_CLASS=hybrid: the tiny model's layers as HybridModel's ``*-*-`` (TE's
    Python on the CPU backend for its final norm, Megatron's local layers), with Domino: the
    job completes, Domino's banner names the pattern, every iteration trains."""
    from te_cpu import te_home

    repo = Path(__file__).resolve().parents[2]
    knobs = job_knobs(
        tmp_path, MODEL_CLASS="hybrid", DOMINO="1", TRAIN_ITERS="20",
        TRAIN_SCRIPT=str(repo / "tests" / "pretrain_te_cpu.py"), PYTHONPATH=str(repo),
        MEGATRON_DOMINO_TE_HOME=str(te_home()),
    )  # fmt: skip
    job = slurm.submit(
        "pretrain_gpt_srun.sh", knobs=knobs, sbatch_args=ASKED, output=tmp_path / "out",
        timeout=JOB_TIMEOUT,
    )  # fmt: skip
    report(job, "pretrain_gpt_srun.sh, MODEL_CLASS=hybrid")
    assert job.completed, job.output[-3000:]
    train_log = (tmp_path / "run" / "train.log").read_text()
    assert "--hybrid-layer-pattern" in train_log and "local_hybrid_stack_spec" in train_log
    assert "of HybridModel pattern '*-*-'" in train_log
    assert list(losses(tmp_path / "run" / "log.jsonl")) == list(range(1, 21))
