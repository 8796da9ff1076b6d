"""The four parts of the GPU check, as the parent process runs them, each within a budget.

Each function returns a :class:`~lab.gpu_check.results.PartResult` and never
raises for a failure of the thing it checks: a rank that crashes or hangs past the budget is a
``failed`` part with the traceback's last lines as the reason. A part that cannot run is
``skipped`` with the reason, and cases a part had to leave out are its ``skipped_cases``: the
run's verdict counts both as incomplete, never as passed. The parent imports neither
Megatron-Core nor the model code; the ranks do (:mod:`lab.launch.ranks`).

The four parts stay in one module (about 400 lines): each is the same shape, a budgeted run
of ranks turned into one verdict, and the summary table reads them side by side. What a part's
rows mean (their summary line and table) is in the part's own module.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from lab.gpu_check import check_equivalence, check_overlap, gemm, markdown, probe
from lab.gpu_check.probe import Collectives, staging_plan
from lab.gpu_check.results import Part, PartResult, say
from lab.launch.ranks import RankFailure, run_ranks
from megatron_domino.base.settings import setting

__all__ = [
    "Collectives",
    "model_parts_unavailable",
    "run_equivalence",
    "run_gemm",
    "run_overlap",
    "run_part_ranks",
    "run_probe",
    "say",
    "staging_plan",
]

PROBE = Part(
    "probe",
    "0. gloo probe",
    "lab.gpu_check.probe:probe_rank",
    failure_summary="the probe did not finish;",
    init="plain",
)
EQUIVALENCE = Part(
    "equivalence",
    "1. equivalence (TP=2, loss + grads)",
    "lab.gpu_check.check_equivalence:equivalence_rank",
)
OVERLAP = Part(
    "overlap",
    "2. overlap structure (event recorder)",
    "lab.gpu_check.check_overlap:overlap_rank",
)
GEMM = Part("gemm", "3. GEMM efficiency (p x k splits)")


def _failure_reason(error: BaseException, lines: int = 6) -> str:
    text = str(error).strip().splitlines()
    tail = text[-lines:] if len(text) > lines else text
    return " / ".join(line.strip() for line in tail if line.strip())


def _megatron_install_hint() -> str:
    try:  # version.py needs packaging, which is checked below
        from megatron_domino.base.version import PINNED_MEGATRON_CORE
    except ImportError:
        return "pip install megatron-core"
    return f"pip install megatron-core=={PINNED_MEGATRON_CORE}"


def model_parts_unavailable() -> str | None:
    """Why parts 1 and 2 cannot run here (a missing package), or ``None``."""
    for module, install in (
        ("megatron.core", _megatron_install_hint()),
        ("numpy", "pip install numpy"),
        ("packaging", "pip install packaging"),
    ):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return f"{module} is not importable here ({install}); it runs the model parts."
    from megatron_domino.base.version import (
        UnsupportedMegatronVersion,
        check_megatron_core_version,
    )

    try:
        check_megatron_core_version()
    except UnsupportedMegatronVersion as error:
        return str(error)
    return None


def run_probe(device: str, budget_s: float) -> tuple[PartResult, dict[str, bool | None]]:
    """Part 0: which collectives gloo runs on ``device`` tensors (two ranks)."""
    say(f"probe: gloo collectives on {device} tensors, 2 ranks (budget {budget_s:.0f} s)")
    start = time.monotonic()
    per_rank, failed_part = run_part_ranks(PROBE, budget_s=budget_s, device=device, args=(device,))
    if failed_part is not None:
        return failed_part, dict.fromkeys(probe.COLLECTIVES)
    outcomes = per_rank[0]
    lines = probe.describe(outcomes)
    for line in lines:
        say(f"probe: {line}")
    supported = probe.supported(outcomes)
    table = markdown.table(
        ("collective", "dtype", "mode", "result"),
        (
            (o.collective, o.dtype, "async_op=True" if o.async_op else "blocking",
             "works" if o.ok else o.error)
            for o in outcomes
        ),
    )  # fmt: skip
    part = PROBE.result(
        "passed",
        "; ".join(lines),
        budget_s,
        start=start,
        details={"outcomes": [o.__dict__ for o in outcomes], "supported": supported},
        table=table,
    )
    return part, supported


def run_part_ranks(
    part: Part, *, budget_s: float, device: str, args: tuple, notes: list[str] | None = None
) -> tuple[list | None, PartResult | None]:
    """Run ``part.target(*args)`` on the part's ranks within its budget.

    Returns ``(per-rank results, None)``, or ``(None, the part's failed result)`` when a rank
    raised, died or ran out of time.
    """
    start = time.monotonic()
    try:
        per_rank = run_ranks(
            part.target,
            part.world_size,
            device=device,
            args=args,
            timeout_s=budget_s,
            init=part.init,
        )
        return per_rank, None
    except RankFailure as error:
        reason = _failure_reason(error)
        return None, part.result(
            "failed", part.failure_summary, budget_s, start=start, reason=reason, notes=notes or []
        )


def _runnable(items, collectives: Collectives, name_of) -> tuple[list, list[tuple]]:
    """``(items that can run, [(item, collectives it lacks), ...])``: a setting on a
    sequence-parallel model needs gathers and scatters that gloo may lack on the device."""
    runnable, skipped = [], []
    for item in items:
        missing = collectives.missing_for(setting(name_of(item)).sequence_parallel)
        if missing:
            skipped.append((item, missing))
        else:
            runnable.append(item)
    return runnable, skipped


@dataclass(frozen=True)
class _Plan:
    """A model part's work after leaving out what gloo cannot run on the device.

    Attributes:
        runnable: the cases (part 1) or settings (part 2) that run.
        skipped: ``(item, the collectives it lacks)`` for each left out.
        notes: the host-staging caveats of the run.
        skipped_cases: one line per left-out item, with its reason, for the report.
    """

    runnable: list
    skipped: list[tuple]
    notes: list[str]
    skipped_cases: list[str]


def _plan(
    part: Part,
    items: Callable[[], list],
    name_of: Callable[[object], str],
    collectives: Collectives,
    budget_s: float,
    skip_line: Callable[[object, list[str]], str],
    nothing_runs: Callable[[list[tuple]], str],
) -> _Plan | PartResult:
    """Parts 1 and 2 before they run: the part ``skipped`` when Megatron-Core is missing or
    every item (``items()``; ``name_of`` gives its setting) lacks a collective (the reason:
    ``nothing_runs(skipped)``), else what runs and what is left out (``skip_line``)."""
    unavailable = model_parts_unavailable()
    if unavailable:
        return part.skipped(unavailable, budget_s)
    runnable, skipped = _runnable(items(), collectives, name_of)
    notes = collectives.staging_note()
    skipped_cases = [skip_line(item, missing) for item, missing in skipped]
    if not runnable:
        return part.skipped(nothing_runs(skipped), budget_s, notes, skipped_cases)
    return _Plan(runnable, skipped, notes, skipped_cases)


def _model_part(
    part: Part,
    check: ModuleType,
    plan: _Plan,
    device: str,
    quick: bool,
    collectives: Collectives,
    budget_s: float,
    outcome: Callable[[list[dict], list], tuple[str, dict, str]],
) -> PartResult:
    """Parts 1 and 2: the part's target on the TP ranks within the budget, its per-rank results
    merged (``check.merge_ranks``) into rows that each passed or not, judged into one result.

    Args:
        check: the part's module: ``merge_ranks(per_rank) -> rows`` and ``failure(row)``, the
            words naming a failed row in the part's reason.
        outcome: ``(rows, per-rank results) -> (summary, details, table)`` of the part.
    """
    start = time.monotonic()
    args = (plan.runnable, device, quick, list(collectives.staged))
    per_rank, failed_part = run_part_ranks(
        part, budget_s=budget_s, device=device, args=args, notes=plan.notes
    )
    if failed_part is not None:
        failed_part.skipped_cases = plan.skipped_cases
        return failed_part
    rows = check.merge_ranks(per_rank)
    failed = [check.failure(row) for row in rows if not row["passed"]]
    summary, details, table = outcome(rows, per_rank)
    return part.judged(
        failed,
        summary,
        budget_s,
        start=start,
        notes=plan.notes,
        skipped_cases=plan.skipped_cases,
        details=details,
        table=table,
    )


def run_equivalence(
    device: str, quick: bool, collectives: Collectives, budget_s: float
) -> PartResult:
    """Part 1: Domino vs unpatched Megatron-Core, loss and every gradient, TP = 2."""
    plan = _plan(
        EQUIVALENCE,
        lambda: check_equivalence.plan(device=device, quick=quick),
        lambda case: case["setting"],
        collectives,
        budget_s,
        skip_line=lambda c, missing: (
            f"{c['flavour']} {c['dtype']} {c['setting']}: gloo cannot run {', '.join(missing)} "
            f"on {device} tensors and --host-staging is never"
        ),
        nothing_runs=lambda skipped: (
            f"every case needs a collective gloo lacks on {device}: "
            + "; ".join(sorted({", ".join(m) for _, m in skipped}))
        ),
    )
    if isinstance(plan, PartResult):
        return plan
    say(
        f"equivalence: {len(plan.runnable)} cases on 2 ranks ({device}), budget {budget_s:.0f} "
        f"s, staged: {', '.join(collectives.staged) or 'nothing'}"
    )

    def outcome(rows: list[dict], per_rank: list) -> tuple[str, dict, str]:
        summary = check_equivalence.summary(rows, len(plan.runnable))
        if plan.skipped:
            summary += f"; {len(plan.skipped)} cases skipped"
        details = {
            "cases": rows,
            "skipped": [dict(c, missing=m) for c, m in plan.skipped],
            "numerics": per_rank[0]["numerics"],
        }
        return summary, details, check_equivalence.table(rows)

    return _model_part(
        EQUIVALENCE, check_equivalence, plan, device, quick, collectives, budget_s, outcome
    )


def run_overlap(device: str, quick: bool, collectives: Collectives, budget_s: float) -> PartResult:
    """Part 2: collective counts and overlap from the event recorder (CUDA events on a GPU)."""
    plan = _plan(
        OVERLAP,
        lambda: list(check_overlap.OVERLAP_SETTINGS),
        lambda name: name,
        collectives,
        budget_s,
        skip_line=lambda name, _: (
            f"{name}: a collective it needs is unsupported on {device} and --host-staging is never"
        ),
        nothing_runs=lambda _: "every setting needs a missing collective",
    )
    if isinstance(plan, PartResult):
        return plan
    timing = "CUDA events" if device == "cuda" else "wall clock"
    say(f"overlap: {', '.join(plan.runnable)} on 2 ranks, {timing}, budget {budget_s:.0f} s")
    plan.notes.append(
        "exposed/in-flight times are two ranks on one GPU over gloo (reductions on the host), "
        "not NVLink: a plausibility check of the recorder, not Domino's speed-up."
        if device == "cuda"
        else "exposed/in-flight times are CPU wall clock over loopback gloo."
    )

    def outcome(rows: list[dict], _per_rank: list) -> tuple[str, dict, str]:
        details = {"settings": rows, "skipped": [name for name, _ in plan.skipped]}
        return check_overlap.summary(rows, timing), details, check_overlap.table(rows)

    return _model_part(OVERLAP, check_overlap, plan, device, quick, collectives, budget_s, outcome)


def run_gemm(
    device: str,
    spec: dict[str, tuple[int, ...]],
    budget_s: float,
    *,
    warmup: int,
    iters: int,
    progress: Callable[[str], None] = say,
) -> PartResult:
    """Part 3: TFLOP/s of the layer's GEMMs per (shape, p, k), and the ratio to p = k = 1."""
    import torch

    start = time.monotonic()
    try:
        configs = gemm.configurations(spec)
    except ValueError as error:
        return GEMM.result("failed", "invalid shape set;", budget_s, reason=str(error))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    say(
        f"gemm: {len(configs)} configurations, {str(dtype).removeprefix('torch.')}, "
        f"{'CUDA events' if device == 'cuda' else 'wall clock'}, budget {budget_s:.0f} s"
    )
    try:
        rows, untimed = gemm.time_configurations(
            configs,
            device=device,
            dtype=dtype,
            warmup=warmup,
            iters=iters,
            deadline=start + budget_s,
            progress=progress,
        )
    except Exception as error:  # noqa: BLE001 - e.g. out of memory: report, do not crash
        reason = f"{type(error).__name__}: {_failure_reason(error, 2)}"
        return GEMM.result("failed", "timing failed;", budget_s, start=start, reason=reason)
    notes = []
    if untimed:
        notes.append(
            f"time budget reached: {len(rows)} of {len(configs)} configurations timed, "
            f"{untimed} not (raise it with --budget gemm=SECONDS or narrow the shape set)"
        )
    if device == "cpu":
        notes.append("CPU wall-clock GEMM times only exercise the code; they say nothing of a GPU.")
    ratios = [
        (r["fwd_ratio"], r) for r in rows if r["fwd_ratio"] is not None and r["p"] * r["k"] > 1
    ]
    summary = f"{len(rows)} configurations timed ({str(dtype).removeprefix('torch.')})"
    if ratios:
        low, row = min(ratios, key=lambda pair: pair[0])
        high = max(ratio for ratio, _ in ratios)
        bwd = [r["bwd_ratio"] for _, r in ratios]
        autograd = [r["bwd_autograd_ratio"] for _, r in ratios]
        summary += (
            f"; fwd TFLOP/s vs p=1,k=1 from {low:.2f}x (h={row['hidden']} b={row['micro_batch']} "
            f"s={row['seq']} p={row['p']} k={row['k']}) to {high:.2f}x; bwd (fused wgrad) from "
            f"{min(bwd):.2f}x to {max(bwd):.2f}x, without fusion from {min(autograd):.2f}x to "
            f"{max(autograd):.2f}x"
        )
    return GEMM.result(
        "passed" if rows else "failed",
        summary,
        budget_s,
        start=start,
        reason=None if rows else "no configuration finished within the budget",
        notes=notes,
        details={
            "spec": {k: list(v) for k, v in spec.items()},
            "dtype": str(dtype),
            "warmup": warmup,
            "iters": iters,
            "rows": rows,
            "untimed": untimed,
        },
        table=gemm.gemm_table(rows) + "\n\nTFLOP/s per rank; ratio: layer TFLOP/s over p=1,k=1.",
    )
