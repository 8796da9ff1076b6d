"""The GPU check's results: one record per part, the machine it ran on, Markdown and JSON.

Every part ends ``passed``, ``failed`` or ``skipped``; ``failed`` and ``skipped`` carry the
reason. The run's verdict (:func:`verdict`) is ``failed`` when a part failed, else
``incomplete`` when a part, or a case inside a part, was skipped: every part runs on either
device (none needs Transformer Engine, and ``--device cpu`` runs the same cases), so a skip is
never by design, and a skipped check must not read as a passed one. :func:`write_results`
saves ``results.json`` (everything, machine-readable) and ``summary.md`` (the detail tables,
then the summary table) into one directory per run.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_domino.tools.provenance import describe, provenance

__all__ = ["Part", "PartResult", "environment", "say", "summary_table", "verdict", "write_results"]

STATUSES = ("passed", "failed", "skipped")
#: The run's verdicts, and the exit status of ``python -m lab.gpu_check`` for each
#: (2 is taken: no CUDA device).
EXIT_STATUS = {"passed": 0, "failed": 1, "incomplete": 3}


@dataclass
class PartResult:
    """One part of the check.

    Attributes:
        name: short key (``probe``, ``equivalence``, ``overlap``, ``gemm``).
        title: what the summary table calls it.
        status: ``passed``, ``failed`` or ``skipped``.
        summary: one line for the summary table.
        reason: why it failed or was skipped (``None`` when it passed).
        elapsed_s: wall time the part took.
        budget_s: its time budget.
        notes: caveats the reader must see (host staging, budget cut-offs).
        skipped_cases: cases of this part that did not run, each with the reason (they make
            the run incomplete even when the part passed).
        details: everything measured, for the JSON file.
        table: a Markdown detail table, printed before the summary.
    """

    name: str
    title: str
    status: str
    summary: str
    reason: str | None = None
    elapsed_s: float = 0.0
    budget_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    skipped_cases: list[str] = field(default_factory=list)
    details: dict = field(default_factory=dict)
    table: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}.")


#: The tensor-parallel ranks a model part runs on.
TP = 2


def say(message: str) -> None:
    """A progress line of the check."""
    print(f"[gpu_check] {message}", flush=True)


@dataclass(frozen=True)
class Part:
    """What a part of the check is, before it runs: its key and title in the summary, and what
    its ranks run (:func:`lab.gpu_check.parts.run_part_ranks`). Each part's
    module declares one, and builds its :class:`PartResult` from it, so the key and title are
    written once.

    Attributes:
        name: short key (``probe``, ``equivalence``, ...).
        title: what the summary table calls it.
        target: ``"module:function"`` each rank runs; ``None`` for a part run in the parent.
        failure_summary: the summary line when a rank raised, died or ran out of time.
        world_size: ranks (processes) it runs on: the TP ranks unless told.
        init: :func:`~lab.launch.ranks.run_ranks`' ``init``.
    """

    name: str
    title: str
    target: str | None = None
    failure_summary: str = "a rank failed;"
    world_size: int = TP
    init: str = "megatron"

    def result(
        self, status: str, summary: str, budget_s: float, *, start: float | None = None, **fields
    ) -> PartResult:
        """The part's result; ``start`` (a ``time.monotonic()``) gives its elapsed time."""
        elapsed_s = 0.0 if start is None else time.monotonic() - start
        return PartResult(
            name=self.name,
            title=self.title,
            status=status,
            summary=summary,
            elapsed_s=elapsed_s,
            budget_s=budget_s,
            **fields,
        )

    def judged(
        self, failed: list[str], summary: str, budget_s: float, *, start: float, **fields
    ) -> PartResult:
        """``passed``, or ``failed`` naming each of ``failed`` (the rows that did not pass)."""
        status = "failed" if failed else "passed"
        reason = "failed: " + "; ".join(failed) if failed else None
        return self.result(status, summary, budget_s, start=start, reason=reason, **fields)

    def skipped(
        self,
        reason: str,
        budget_s: float,
        notes: list[str] | None = None,
        skipped_cases: list[str] | None = None,
    ) -> PartResult:
        """The part could not run, and why."""
        say(f"{self.name}: skipped: {reason}")
        return self.result(
            "skipped",
            "",
            budget_s,
            reason=reason,
            notes=notes or [],
            skipped_cases=skipped_cases or [],
        )


def environment(device: str) -> dict[str, object]:
    """Date, machine, device and versions, for the report (a
    :func:`~megatron_domino.tools.provenance.provenance` record with the device)."""
    return provenance(device=device)


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def verdict(parts: list[PartResult]) -> tuple[str, str]:
    """The run's verdict (a key of :data:`EXIT_STATUS`) and the summary's overall line.

    ``failed`` if any part failed; else ``incomplete`` if any part or case was skipped (the
    line names each, with its reason); else ``passed``.
    """
    failed = [p.title for p in parts if p.status == "failed"]
    not_run = [
        f"{p.title} was skipped: {(p.reason or '').rstrip('.')}"
        for p in parts
        if p.status == "skipped"
    ]
    not_run += [
        f"{p.title} skipped {len(p.skipped_cases)} case(s): {'; '.join(p.skipped_cases)}"
        for p in parts
        if p.skipped_cases and p.status != "skipped"
    ]
    if failed:
        line = "FAILED: " + ", ".join(failed)
        if not_run:
            line += ". Also not run: " + ". ".join(not_run)
        return "failed", f"**Overall: {line}.**"
    if not_run:
        return "incomplete", (
            "**Overall: INCOMPLETE, not passed (exit status "
            f"{EXIT_STATUS['incomplete']}; a skipped check checks nothing): "
            + ". ".join(not_run)
            + ".**"
        )
    return "passed", "**Overall: passed.**"


def summary_table(env: dict, parts: list[PartResult], results_path: Path | None = None) -> str:
    """The Markdown summary: one row per part, then the overall verdict and the caveats."""
    lines = [
        f"## GPU check summary: {describe(env)}",
        "",
        "| part | status | time | result |",
        "|---|---|---|---|",
    ]
    for part in parts:
        result = part.summary if part.reason is None else f"{part.summary} {part.reason}".strip()
        lines.append(
            f"| {_cell(part.title)} | {part.status} | {part.elapsed_s:.0f} s of "
            f"{part.budget_s:.0f} s | {_cell(result)} |"
        )
    lines += ["", verdict(parts)[1]]
    notes = [f"{p.title}: {note}" for p in parts for note in p.notes]
    if notes:
        lines += ["", "Notes:", *[f"- {_cell(note)}" for note in notes]]
    if results_path is not None:
        lines += ["", f"Results: {results_path}"]
    return "\n".join(lines)


def write_results(out_dir: Path, env: dict, parts: list[PartResult], argv: list[str]) -> Path:
    """Write ``results.json`` and ``summary.md`` into ``out_dir``; return ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "environment": env,
        "argv": argv,
        "overall": verdict(parts)[0],
        "parts": [asdict(p) for p in parts],
    }
    (out_dir / "results.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    tables = [f"### {p.title}\n\n{p.table}\n" for p in parts if p.table]
    summary = summary_table(env, parts, out_dir)
    (out_dir / "summary.md").write_text("\n".join([*tables, summary]) + "\n")
    return out_dir
