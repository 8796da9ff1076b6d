"""``python -m lab.gpu_check``: its logic on the CPU, and the real check on a GPU.

The GPU check cannot run here, so the CPU tests run the same code paths with
``--device cpu --quick`` (gloo, fp32, tiny shapes, wall clock) through the wrapper script, with
the model parts going through the host-staging shim (which every rank job verifies on two
ranks), check the shim's patching in process, and guard the shared comparison helpers against
drifting from the CPU equivalence and overlap tests they were factored from. A part that
should run and is skipped (here: Megatron-Core shadowed by an empty package) must make the
run fail with exit status 3 and say so in the summary. The test marked ``gpu`` runs the check
on CUDA and is skipped without a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lab.gpu_check import (
    check_host_time,
    check_inflight,
    cli,
    gemm,
    parts,
    probe,
)
from lab.gpu_check.results import EXIT_STATUS, PartResult, verdict

ROOT = Path(__file__).resolve().parents[2]
WRAPPER = ROOT / "scripts" / "gpu_check.sh"


def _run_wrapper(
    out_dir: Path, *flags: str, timeout: int, pythonpath: Path | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPU_CHECK_OUT_DIR": str(out_dir), "PYTHON": sys.executable}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(
        ["bash", str(WRAPPER), *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# --- end to end on the CPU -------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("gpu_check")
    # --host-staging always: the model parts run through the test-only shim, which each rank
    # job first verifies with the probe's checks on two ranks; without it (the default on the
    # CPU, where gloo runs everything) the code path differs only by that shim.
    done = _run_wrapper(
        out_dir, "--device", "cpu", "--quick", "--host-staging", "always", timeout=480
    )
    return out_dir, done


def test_cpu_quick_run_passes_and_prints_the_summary_last(cpu_run):
    out_dir, done = cpu_run
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    run_dir = out_dir / os.readlink(out_dir / "latest")
    # The wrapper's path line, then the summary table's last lines.
    assert lines[-1] == f"gpu_check results: {run_dir}"
    assert lines[-2] == f"Results: {run_dir}"
    assert "**Overall: passed.**" in lines
    summary = done.stdout[done.stdout.index("## GPU check summary") :]
    for title in (
        "0. gloo probe",
        "1. equivalence",
        "2. overlap structure",
        "3. GEMM efficiency",
        "4. in-flight collectives",
        "5. host time vs device time",
    ):
        assert f"| {title}" in summary
    assert "###" not in summary, "detail tables must come before the summary"
    assert (run_dir / "summary.md").read_text().rstrip().endswith(f"Results: {run_dir}")


def test_cpu_quick_run_writes_the_json_record(cpu_run):
    out_dir, _ = cpu_run
    record = json.loads((out_dir / "latest" / "results.json").read_text())
    env = record["environment"]
    assert env["device"] == "cpu" and env["gpu"] is None
    assert env["torch"] == torch.__version__ and env["date"]
    assert record["overall"] == "passed"
    assert "TEST-ONLY shim" in " ".join(record["parts"][1]["notes"])
    by_name = {p["name"]: p for p in record["parts"]}
    assert {name: p["status"] for name, p in by_name.items()} == dict.fromkeys(
        ("probe", "equivalence", "overlap", "gemm", "inflight", "host"), "passed"
    )
    assert by_name["probe"]["details"]["supported"] == dict.fromkeys(probe.COLLECTIVES, True)
    cases = by_name["equivalence"]["details"]["cases"]
    settings = ["p2", "p2-k2", "s2", "revert (plain)", "sp-p2", "sp-s2", "revert (sp)"]
    assert [(c["dtype"], c["setting"]) for c in cases] == [
        (dtype, setting) for dtype in ("bfloat16", "float32") for setting in settings
    ]
    assert all(c["passed"] for c in cases)
    assert all(c["max_error"] < 1e-6 for c in cases if c["dtype"] == "float32")
    # bf16: measured against fp32, within the bound, with stock's own error as the yardstick.
    bf16 = [c for c in cases if c["dtype"] == "bfloat16" and "revert" not in c["setting"]]
    assert all(0 < c["stock_error"] < 0.05 and c["limit_use"] <= 1 for c in bf16)
    assert all(c["tolerance"].startswith("per tensor vs fp32") for c in bf16)
    # Two input-gradient all-reduces per layer and chunk (2 layers, p = 2) without SP.
    assert [c["dgrad_slots"] for c in cases if c["setting"] in ("p2", "p2-k2", "s2")] == [8] * 6
    overlap = {s["setting"]: s for s in by_name["overlap"]["details"]["settings"]}
    # Per layer and chunk 2 x 2 pieces forward, 2 backward; per chunk the model's two ends.
    assert overlap["p2-k2"]["counts"] == {"bwd ar": 14, "fwd ar": 26}
    assert overlap["s2"]["counts"] == {"bwd ar": 14, "fwd ar": 14}
    assert overlap["sp-s2"]["counts"] == overlap["sp-p2"]["counts"]  # sequence split, same
    assert overlap["sp-p2"]["counts"] == {
        "bwd ag": 12,
        "bwd regather": 12,
        "bwd rs": 12,
        "fwd ag": 12,
        "fwd rs": 12,
    }
    assert all(s["passed"] and s["timing"] == "wall clock" for s in overlap.values())
    rows = by_name["gemm"]["details"]["rows"]
    assert [(r["p"], r["k"]) for r in rows] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert rows[0]["fwd_ratio"] == rows[0]["bwd_ratio"] == 1.0
    assert all(r["fwd_tflops"] > 0 and r["bwd_tflops"] > 0 for r in rows)
    assert all(r["bwd_autograd_tflops"] > 0 for r in rows)
    assert [r["chunk_copy_ms"] > 0 for r in rows] == [False, False, True, True]
    inflight = by_name["inflight"]["details"]
    assert inflight["backend"].startswith("gloo")
    assert [c["case"] for c in inflight["cases"]] == list(check_inflight.CASES)
    assert all(c["passed"] and c["launches"] == 1 for c in inflight["cases"])
    host = by_name["host"]["details"]["rows"]
    assert [(r["micro_batch"], r["arm"]) for r in host] == [
        (b, arm) for b, arms in check_host_time.ARMS.items() for arm in arms
    ]
    assert all(r["host_ms"] > 0 and r["device_ms"] is None for r in host)
    assert all(r["verdict"] == "n/a (CPU: host only)" for r in host)
    stock_ops = {r["micro_batch"]: r["aten_ops"] for r in host if r["arm"] == "stock"}
    # Each chunk runs the layer's ops again: about twice stock's dispatched operators.
    assert all(
        r["aten_ops"] > 1.5 * stock_ops[r["micro_batch"]] for r in host if r["arm"] != "stock"
    )


def test_a_skipped_part_fails_the_run_and_says_why(tmp_path):
    """Megatron-Core shadowed by an empty ``megatron`` package: the equivalence part cannot
    run, so the check must not exit 0 (it did, naming the skip beside "passed")."""
    (tmp_path / "shadow" / "megatron").mkdir(parents=True)
    (tmp_path / "shadow" / "megatron" / "__init__.py").write_text("")
    done = _run_wrapper(
        tmp_path / "out",
        *("--device", "cpu", "--quick", "--parts", "equivalence"),
        timeout=120,
        pythonpath=tmp_path / "shadow",
    )
    assert done.returncode == 3, done.stdout[-4000:] + done.stderr[-4000:]
    overall = next(line for line in done.stdout.splitlines() if line.startswith("**Overall"))
    assert overall.startswith("**Overall: INCOMPLETE, not passed (exit status 3")
    assert "1. equivalence (TP=2, loss + grads) was skipped: megatron.core is not importable" in (
        overall
    )
    record = json.loads((tmp_path / "out" / "latest" / "results.json").read_text())
    assert record["overall"] == "incomplete"
    assert [p["status"] for p in record["parts"]] == ["passed", "skipped"]


def test_skipped_cases_make_a_passed_part_incomplete():
    passed = PartResult(name="gemm", title="3. GEMM", status="passed", summary="ok")
    assert verdict([passed]) == ("passed", "**Overall: passed.**")
    partial = PartResult(
        name="overlap",
        title="2. overlap",
        status="passed",
        summary="ok",
        skipped_cases=["sp-p2: a collective it needs is unsupported"],
    )
    state, line = verdict([passed, partial])
    assert state == "incomplete" and "2. overlap skipped 1 case(s): sp-p2: a collective" in line
    failed = PartResult(name="probe", title="0. probe", status="failed", summary="", reason="x")
    state, line = verdict([failed, partial])
    assert state == "failed" and line.startswith("**Overall: FAILED: 0. probe. Also not run:")
    assert EXIT_STATUS == {"passed": 0, "failed": 1, "incomplete": 3}


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_without_cuda_the_check_refuses_and_names_the_cpu_mode(tmp_path):
    done = _run_wrapper(tmp_path, timeout=120)
    assert done.returncode == 2
    assert cli.NO_CUDA in done.stderr and "--device cpu --quick" in done.stderr
    assert "gpu_check results:" not in done.stdout and not (tmp_path / "latest").exists()


# --- the host-staging shim, in process ---------------------------------------------------------


@pytest.fixture
def one_rank_group():
    """A world-size-1 gloo group in this process, destroyed afterwards."""
    import torch.distributed as dist

    from lab.launch.ranks import free_port

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_host_staging_shim_patches_megatron_too_and_restores_everything(one_rank_group):
    """What the two-rank end-to-end run cannot see: which names are replaced, that the
    replacements keep autograd's version counter, and that everything comes back. (That the
    staged collectives really sum across ranks is checked in that run: every rank job verifies
    the shim with the probe's numeric checks before using it.)"""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import layers, mappings

    from lab.gpu_check.host_staging import STAGEABLE, host_staged

    assert STAGEABLE == probe.COLLECTIVES
    originals = {name: getattr(dist, name) for name in STAGEABLE}
    megatron_gather, megatron_scatter = (
        mappings.dist_all_gather_func,
        layers.dist_reduce_scatter_func,
    )
    with host_staged(STAGEABLE, verify_on="cpu") as staged:
        assert staged == list(STAGEABLE)
        assert all(getattr(dist, name) is not originals[name] for name in STAGEABLE)
        assert mappings.dist_all_gather_func is dist.all_gather_into_tensor
        assert layers.dist_reduce_scatter_func is dist.reduce_scatter_tensor
        tensor = torch.ones(4, requires_grad=True).clone()
        version = tensor._version
        work = dist.all_reduce(tensor, async_op=True)
        assert not work.is_completed()
        work.wait()
        assert work.is_completed() and tensor._version == version
        gathered = torch.empty(4)
        assert dist.all_gather_into_tensor(gathered, torch.arange(4.0)) is None
        assert gathered.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert all(getattr(dist, name) is originals[name] for name in STAGEABLE)
    assert mappings.dist_all_gather_func is megatron_gather
    assert layers.dist_reduce_scatter_func is megatron_scatter
    with pytest.raises(ValueError, match="cannot stage 'broadcast'"):
        with host_staged(["broadcast"]):
            pass


# --- planning, without processes --------------------------------------------------------------


def test_staging_plan_policies():
    probe_found = {"all_reduce": True, "all_gather_into_tensor": False}
    auto = parts.staging_plan(probe_found, "auto")
    assert auto.staged == ("all_gather_into_tensor", "reduce_scatter_tensor")
    assert auto.missing_for(True) == [] and auto.staging_note()
    never = parts.staging_plan(probe_found, "never")
    assert never.staged == () and never.missing_for(False) == []
    assert never.missing_for(True) == ["all_gather_into_tensor", "reduce_scatter_tensor"]
    assert parts.staging_plan({}, "always").staged == probe.COLLECTIVES


def test_unsupported_collectives_skip_cases_with_the_reason():
    nothing = parts.staging_plan(dict.fromkeys(probe.COLLECTIVES, False), "never")
    part = parts.run_equivalence("cuda", True, nothing, budget_s=1)
    assert part.status == "skipped" and "all_reduce" in part.reason
    assert len(part.skipped_cases) == 10 and verdict([part])[0] == "incomplete"  # 5 x 2 dtypes
    sp_only = parts.staging_plan({"all_reduce": True}, "never")
    part = parts.run_overlap("cpu", True, sp_only, budget_s=0.001)
    # The plain settings run (and fail on the impossible budget); sp-p2 is skipped by name.
    assert part.status == "failed" and part.skipped_cases[0].startswith("sp-p2: ")


def test_gemm_configurations_put_the_baseline_first_and_validate():
    configs = gemm.configurations(gemm.PRESETS["paper"])
    assert len(configs) == 2 * 3 * 3 * 3 * 3
    assert all((c.chunks, c.column_chunks) == (1, 1) for c in configs[::9])
    with pytest.raises(ValueError, match="not divisible by p=4"):
        gemm.configurations(dict(gemm.PRESETS["cpu"], micro_batch=(2,), chunks=(4,)))
    args = cli.parse_args(["--device", "cpu", "--gemm-hidden", "512", "--gemm-chunks", "1,4"])
    spec = cli.gemm_spec(args)
    assert spec["hidden"] == (512,) and spec["chunks"] == (1, 4) and spec["tp"] == (2,)
    assert cli.gemm_spec(cli.parse_args([]))["hidden"] == (4096, 8192)
    assert cli.gemm_spec(cli.parse_args(["--quick"]))["seq"] == (1024,)


def test_gemm_timing_stops_at_the_deadline():
    configs = gemm.configurations(gemm.PRESETS["cpu"])
    rows, untimed = gemm.time_configurations(
        configs,
        device="cpu",
        dtype=torch.float32,
        warmup=0,
        iters=1,
        deadline=0.0,
        progress=lambda _: None,
    )
    assert rows == [] and untimed == len(configs)


def test_budget_and_parts_flags_are_validated():
    args = cli.parse_args(["--budget", "gemm=30", "--parts", "gemm,probe"])
    assert args.budget == [("gemm", 30.0)] and args.parts == ("gemm", "probe")
    for bad in (["--budget", "gemm"], ["--budget", "nope=3"], ["--parts", "equivalence,x"]):
        with pytest.raises(SystemExit):
            cli.parse_args(bad)


# --- the shared count formula matches the CPU tests' ------------------------------------------


def test_expected_counts_match_the_cpu_overlap_tests(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "ranks"))
    import test_domino_overlap as overlap_test
    import test_domino_sequence_parallel as sp_test

    from megatron_domino.analysis.criteria import expected_collective_counts

    for config in overlap_test.SETTINGS.values():
        want = expected_collective_counts(
            config, num_layers=overlap_test.LAYERS, sequence_parallel=False
        )
        p, k = config.chunks, config.column_chunks
        assert want["fwd", "ar"] == overlap_test.LAYERS * 2 * p * k
        assert want["bwd", "ar"] == (overlap_test.LAYERS * 2 * p if config.backward_overlap else 0)
    for config in sp_test.SETTINGS.values():
        want = expected_collective_counts(config, num_layers=sp_test.LAYERS, sequence_parallel=True)
        p, k = config.chunks, config.column_chunks
        assert want["fwd", "ag"] == want["bwd", "ag"] == sp_test.LAYERS * 2 * p
        assert want["fwd", "rs"] == want["bwd", "rs"] == sp_test.LAYERS * 2 * p * k


# --- the real thing --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_check_on_cuda(tmp_path):
    """The check on this machine's GPU (``--quick``: the full run is the script itself)."""
    done = _run_wrapper(tmp_path, "--quick", timeout=600)
    print(done.stdout[-8000:])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    record = json.loads((tmp_path / "latest" / "results.json").read_text())
    assert record["environment"]["gpu"] and record["overall"] == "passed"
    assert all(part["status"] == "passed" for part in record["parts"]), record["parts"]


# --- the offline command: the lent machine's python, a carried wheel, one results folder --------

OFFLINE = ROOT / "scripts" / "gpu_check_offline.sh"

#: Put first on PYTHONPATH: hides this environment's megatron-core, as on the lent machine.
_HIDE_INSTALLED_MEGATRON = """
import sys
from importlib.machinery import PathFinder


class _HideInstalledMegatron:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "megatron":
            return None
        spec = PathFinder.find_spec(name, [p for p in sys.path if "site-packages" not in p])
        if spec is None:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden)", name=name)
        return spec


sys.meta_path.insert(0, _HideInstalledMegatron)
"""


def _stand_in_wheel(folder: Path) -> Path:
    """A minimal ``megatron_core`` wheel (a bare ``megatron.core``): what pip installs."""
    import zipfile

    folder.mkdir(parents=True)
    wheel = folder / "megatron_core-0.19.2-py3-none-any.whl"
    info = "megatron_core-0.19.2.dist-info"
    files = {
        "megatron/core/__init__.py": "STAND_IN = True\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: megatron-core\nVersion: 0.19.2\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in {**files, f"{info}/RECORD": record}.items():
            archive.writestr(name, text)
    return wheel


def _run_offline(tmp_path: Path, results: Path, *flags: str, wheels: Path, timeout: int):
    hide = tmp_path / "hide"
    hide.mkdir(exist_ok=True)
    (hide / "sitecustomize.py").write_text(_HIDE_INSTALLED_MEGATRON)
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "PYTHONPATH": str(hide),
        "WHEELS": str(wheels),
        "SITE": str(tmp_path / "site"),
    }
    return subprocess.run(
        ["bash", str(OFFLINE), str(results), *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
    )


def test_offline_command_installs_the_carried_wheel_and_fills_the_results_folder(tmp_path):
    _stand_in_wheel(tmp_path / "wheels")
    results = tmp_path / "out" / "check"
    done = _run_offline(
        tmp_path,
        results,
        "--device",
        "cpu",
        "--parts",
        "inflight",
        wheels=tmp_path / "wheels",
        timeout=180,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "into " + str(tmp_path / "site") + " (pip --target" in done.stdout
    assert (tmp_path / "site" / "megatron" / "core" / "__init__.py").read_text() == (
        "STAND_IN = True\n"
    )
    assert sorted(p.name for p in results.iterdir()) == ["results.json", "summary.md"]
    record = json.loads((results / "results.json").read_text())
    assert [(p["name"], p["status"]) for p in record["parts"]] == [("inflight", "passed")]
    assert "**Overall: passed.**" in (results / "summary.md").read_text()
    assert not (results.parent / "latest").exists()


def test_offline_command_without_megatron_or_wheel_says_how_to_get_it(tmp_path):
    (tmp_path / "wheels").mkdir()
    results = tmp_path / "check"
    done = _run_offline(
        tmp_path, results, "--device", "cpu", "--quick", wheels=tmp_path / "wheels", timeout=60
    )
    assert done.returncode == 4
    assert (
        "holds 0 megatron_core wheels" in done.stderr and "scripts/fetch_wheels.sh" in done.stderr
    )
    assert not results.exists()
    done = subprocess.run(["bash", str(OFFLINE)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 4 and "RESULTS_DIR" in done.stderr


def test_run_dir_must_be_new_or_empty_and_budgets_fit_the_lease(tmp_path):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "summary.md").write_text("an earlier run")
    with pytest.raises(SystemExit):
        cli.parse_args(["--run-dir", str(tmp_path / "used")])
    assert cli.parse_args(["--run-dir", str(tmp_path / "new")]).run_dir == tmp_path / "new"
    assert set(cli.DEFAULT_BUDGETS_S) == set(cli.QUICK_BUDGETS_S) == set(cli.PARTS)
    # Quick under 4 minutes and full under 8 on the lent machine, start-up and install included.
    # (Opt-in parts, run with --parts, are not in that run.)
    assert sum(cli.QUICK_BUDGETS_S[part] for part in cli.DEFAULT_PARTS) <= 215
    assert sum(cli.DEFAULT_BUDGETS_S[part] for part in cli.DEFAULT_PARTS) <= 450


# --- the new parts' logic, in process -----------------------------------------------------------


def test_inflight_cases_fail_when_a_wait_returns_before_the_data(one_rank_group, monkeypatch):
    from megatron_domino.communication import collectives

    rows = {r["case"]: r for r in check_inflight.inflight_rank("cpu")}
    assert all(r["passed"] for r in rows.values()), rows
    wait = collectives.SequenceCollective.wait

    def too_early(self):
        output = wait(self)
        return torch.full_like(output, float("nan"))  # what a read before NCCL finished sees

    monkeypatch.setattr(collectives.SequenceCollective, "wait", too_early)
    rows = {r["case"]: r for r in check_inflight.inflight_rank("cpu")}
    assert [case for case, r in rows.items() if not r["passed"]] == [
        "SequenceCollective: all-gather",
        "SequenceCollective: reduce-scatter",
    ]


def test_host_time_verdict_is_launch_bound_when_the_host_is_slower():
    assert check_host_time._verdict(dict(host_ms=1.2, device_ms=1.0)) == "launch-bound"
    assert check_host_time._verdict(dict(host_ms=0.5, device_ms=1.0)) == (
        "not launch-bound (host 50% of device)"
    )
    assert check_host_time._verdict(dict(host_ms=0.5, device_ms=None)).startswith("n/a")


def test_gemm_part_runs_what_domino_runs_beside_the_gemms():
    """k > 1: the pieces concatenated in forward; without fusion, each piece's weight gradient
    zero-padded to the whole weight and summed, as the slice's backward does."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    shape = gemm.GemmShape(hidden=64, micro_batch=4, seq=8, tp=2)
    ops = gemm._operands(shape, "cpu", torch.float32)
    for p, k in ((1, 1), (2, 2)):
        config = gemm.GemmConfig(shape, p, k)
        with Ops() as forward:
            gemm._forward(config, ops, "proj")
        with Ops() as autograd:
            gemm._backward_autograd(config, ops, "proj")
        with Ops() as copy:
            gemm._chunk_copy(config, ops)
        assert forward.names.count("cat") == (p if k > 1 else 0)
        assert autograd.names.count("new_zeros") == (p * k if k > 1 else 0)
        assert autograd.names.count("add_") == p * k - 1
        assert copy.names.count("clone") == (p if p > 1 else 0)  # p = 1: already contiguous


# --- part 6: CUDA graph capture (CUDA only) ----------------------------------------------------


def test_capture_is_opt_in_and_skipped_on_the_cpu_when_asked(tmp_path):
    assert "capture" in cli.PARTS and "capture" not in cli.DEFAULT_PARTS
    done = _run_wrapper(tmp_path, "--device", "cpu", "--quick", "--parts", "capture", timeout=120)
    assert done.returncode == 3, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((tmp_path / "latest" / "results.json").read_text())
    (part,) = record["parts"]
    assert part["name"] == "capture" and part["status"] == "skipped"
    assert part["reason"].startswith("needs CUDA")


def test_the_default_run_says_capture_was_not_run(cpu_run):
    _, done = cpu_run
    assert "capture: not run (opt-in, needs CUDA): add --parts capture on a GPU" in done.stdout
