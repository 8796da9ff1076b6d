"""Part 2: the recorded schedule has the structure Domino promises, timed with CUDA events.

On two ranks sharing the GPU, one step (forward and backward) per setting is recorded with
:class:`~megatron_domino.base.recorder.EventRecorder` (CUDA events on the GPU, wall clock with
``--device cpu``) after one warm-up step, and checked with the criteria the CPU overlap tests
use (:mod:`megatron_domino.analysis.criteria`): the number of collectives per direction and
kind, nothing left in flight after the forward or the backward, and each collective having
overlapped another chunk's (or piece's) compute. The recorder's totals (in-flight and exposed
time per direction) are reported as measured; over gloo on one GPU they describe this setup,
not an NVLink system.
"""

from __future__ import annotations

__all__ = [
    "OVERLAP_SETTINGS",
    "LAYERS",
    "failure",
    "merge_ranks",
    "overlap_rank",
    "summary",
    "table",
]

#: Settings recorded: row chunks, chunks with column pieces, pieces alone, and SP.
OVERLAP_SETTINGS = ("p2", "p2-k2", "p1-k2", "s2", "sp-p2", "sp-s2")
LAYERS = 3


def _totals(spans, direction: str) -> dict:
    from megatron_domino.analysis.spans import summarize

    summary = summarize(spans, direction)
    return dict(
        collectives=summary.collectives,
        overlapped=summary.overlapped,
        in_flight_ms=summary.in_flight_s * 1e3,
        exposed_ms=summary.exposed_s * 1e3,
        overlap_share=summary.overlap_share,
    )


def _describe(span) -> str:
    return f"{span.direction} {span.name} layer {span.layer} chunk {span.chunk} piece {span.piece}"


def _record_step(model, batch, config, use_cuda_events: bool):
    """One warm-up step, then one recorded step; the spans and what was left pending."""
    from megatron_domino.analysis.spans import collective_spans
    from megatron_domino.apply import apply_domino
    from megatron_domino.base.recorder import EventRecorder

    recorder = EventRecorder(use_cuda_events=use_cuda_events)
    with apply_domino(model, config, recorder=recorder) as handle:
        for recorded in (False, True):
            if recorded:
                recorder.clear()
            model.zero_grad(set_to_none=True)
            loss = model(**batch).float().mean()
            step = handle.runtime.last_step
            after_forward = len(step.pending_forward) + len(step.pending_backward)
            loss.backward()
            after_backward = len(handle.runtime.last_step.pending_backward)
    return collective_spans(recorder.events()), after_forward, after_backward


def overlap_rank(settings: list[str], device: str, quick: bool, staged: list[str]) -> list[dict]:
    """Record and check each setting on this rank; one result dict per setting.

    Entry point for :func:`~lab.launch.ranks.run_ranks` (``init="megatron"``).
    """
    import torch.distributed as dist

    from lab.analysis.equivalence import token_batch
    from lab.gpu_check.host_staging import host_staged
    from lab.models.gpu_check_models import (
        MICRO_BATCH,
        build_on_device,
        model_options,
    )
    from megatron_domino.analysis.criteria import (
        collective_counts,
        count_mismatches,
        overlap_criterion,
        overlap_violations,
    )
    from megatron_domino.base.settings import setting

    rows = []
    models = {}
    with host_staged(staged, verify_on=device):
        for name in settings:
            named = setting(name)
            config, sequence_parallel = named.config, named.sequence_parallel
            if sequence_parallel not in models:
                options = model_options(
                    "llama",
                    quick=quick,
                    bf16=device == "cuda",
                    sequence_parallel=sequence_parallel,
                    num_layers=LAYERS,
                )
                models[sequence_parallel] = (
                    build_on_device(options, device),
                    token_batch(options, MICRO_BATCH, device=device),
                )
            model, batch = models[sequence_parallel]
            spans, after_forward, after_backward = _record_step(
                model, batch, config, use_cuda_events=device == "cuda"
            )
            problems = count_mismatches(
                spans,
                config,
                num_layers=LAYERS,
                sequence_parallel=sequence_parallel,
                embedding=not sequence_parallel,
                output_layer=not sequence_parallel,
            )
            if after_forward or after_backward:
                problems.append(
                    f"left in flight: {after_forward} after forward, {after_backward} after "
                    "backward"
                )
            violations = overlap_violations(spans, config, sequence_parallel=sequence_parallel)
            problems += [f"overlapped nothing: {_describe(s)}" for s in violations[:5]]
            counts = collective_counts(spans)
            rows.append(
                dict(
                    setting=name,
                    passed=not problems,
                    problems=problems,
                    counts={f"{d} {k}": n for (d, k), n in sorted(counts.items())},
                    criterion=overlap_criterion(config, sequence_parallel=sequence_parallel),
                    fwd=_totals(spans, "fwd"),
                    bwd=_totals(spans, "bwd"),
                    timing="CUDA events" if device == "cuda" else "wall clock",
                )
            )
            if dist.get_rank() == 0:
                fwd, bwd = rows[-1]["fwd"], rows[-1]["bwd"]
                print(
                    f"[gpu_check rank 0] overlap {name}: {fwd['collectives']} fwd / "
                    f"{bwd['collectives']} bwd collectives, exposed {fwd['exposed_ms']:.2f} / "
                    f"{bwd['exposed_ms']:.2f} ms of {fwd['in_flight_ms']:.2f} / "
                    f"{bwd['in_flight_ms']:.2f} ms in flight -> "
                    f"{'ok' if not problems else 'FAILED: ' + problems[0]}",
                    flush=True,
                )
    return rows


def merge_ranks(per_rank: list[list[dict]]) -> list[dict]:
    """Rank 0's rows (its timings), failed where any rank failed, with every rank's problems."""
    merged = []
    for rows in zip(*per_rank, strict=True):
        row = dict(rows[0])
        row["passed"] = all(r["passed"] for r in rows)
        row["problems"] = [f"rank {i}: {p}" for i, r in enumerate(rows) for p in r["problems"]]
        merged.append(row)
    return merged


def failure(row: dict) -> str:
    """A failed row, as the part's reason names it: the setting and its first problem."""
    return f"{row['setting']}: {row['problems'][0]}"


def summary(rows: list[dict], timing: str) -> str:
    """The summary table's line: settings passed, rank 0's exposed and in-flight times."""
    failed = [r for r in rows if not r["passed"]]
    fwd_exposed = sum(r["fwd"]["exposed_ms"] for r in rows)
    fwd_flight = sum(r["fwd"]["in_flight_ms"] for r in rows)
    bwd_exposed = sum(r["bwd"]["exposed_ms"] for r in rows)
    bwd_flight = sum(r["bwd"]["in_flight_ms"] for r in rows)
    summary = (
        f"{len(rows) - len(failed)} of {len(rows)} settings: counts, nothing pending, overlap "
        f"criteria hold; rank 0 exposed/in-flight ({timing}): fwd {fwd_exposed:.2f}/"
        f"{fwd_flight:.2f} ms, bwd {bwd_exposed:.2f}/{bwd_flight:.2f} ms"
    )
    return summary


def _share(totals: dict) -> str:
    share = totals["overlap_share"]
    return "n/a" if share is None else f"{share:.0%}"


def table(rows: list[dict]) -> str:
    """One line per setting: counts, overlap, exposed and in-flight times."""
    table = (
        "| setting | collectives (fwd / bwd) | overlapped (fwd / bwd) | fwd exposed / in flight | "
        "bwd exposed / in flight | overlap share (fwd / bwd) | result |\n|---|---|---|---|---|---|---|\n"
    )
    table += "\n".join(
        f"| {r['setting']} | {r['fwd']['collectives']} / {r['bwd']['collectives']} | "
        f"{r['fwd']['overlapped']} / {r['bwd']['overlapped']} | "
        f"{r['fwd']['exposed_ms']:.2f} / {r['fwd']['in_flight_ms']:.2f} ms | "
        f"{r['bwd']['exposed_ms']:.2f} / {r['bwd']['in_flight_ms']:.2f} ms | "
        f"{_share(r['fwd'])} / {_share(r['bwd'])} | "
        f"{'passed' if r['passed'] else 'FAILED: ' + '; '.join(r['problems'][:2])} |"
        for r in rows
    )
    return table
