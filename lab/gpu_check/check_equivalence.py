"""Part 1: Domino computes what unpatched Megatron-Core computes, on the device, at TP = 2.

Two ranks (two processes sharing the GPU, gloo) build each model once, then
:func:`lab.analysis.equivalence.compare_with_stock` (the comparison the CPU test suite
makes) runs the stock block, Domino for each setting, and stock again after ``revert``. fp32:
the per-token loss and every gradient within ``atol 1e-6, rtol 1e-5`` of stock. bf16: stock and
Domino both measured against an fp32 model with the same weights, and Domino's norm-relative
error on the loss and on each gradient within 1.5 x stock's own
(:data:`lab.analysis.equivalence.BF16_BOUND`). Always: no collective left in flight, and
the reverted model reproducing the reference up to the run-to-run difference of two stock runs.

Cases are (flavour, dtype, setting): ``p2``, ``p2-k2`` and ``s2`` on the plain model, ``sp-p2``
and ``sp-s2`` on the same model with ``--sequence-parallel``, in bf16 and fp32 on either device (bf16 runs
on the CPU too, so the CPU test covers its code). The parent plans them (:func:`plan`) and
drops the ones whose collectives gloo cannot run here when host staging is off.
"""

from __future__ import annotations

from itertools import groupby

__all__ = [
    "CASE_SETTINGS",
    "equivalence_rank",
    "failure",
    "merge_ranks",
    "plan",
    "summary",
    "table",
]

#: Settings compared (names: :mod:`megatron_domino.base.settings`).
CASE_SETTINGS = ("p2", "p2-k2", "s2", "sp-p2", "sp-s2")
#: The bf16-only numbers of a row (``None`` in fp32 rows), merged over ranks by their maximum.
BF16_FIELDS = (
    "domino_error",
    "stock_error",
    "loss_error",
    "stock_loss_error",
    "limit_use",
)


def plan(*, device: str, quick: bool) -> list[dict]:
    """The cases to run: bf16 and fp32 on either device; ``llama`` only with --quick."""
    flavours = ["llama"] if quick else ["gpt", "llama"]
    return [
        dict(flavour=flavour, dtype=dtype, setting=setting)
        for dtype in ("bfloat16", "float32")
        for flavour in flavours
        for setting in CASE_SETTINGS
    ]


def _say(message: str) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(f"[gpu_check rank 0] equivalence {message}", flush=True)


def _bf16_numbers(result, stock_errors: dict[str, float], bound) -> dict[str, object]:
    """Row fields of a bf16 setting: worst gradient errors against fp32 (Domino's and stock's,
    each over all gradients), the loss's, and the largest share of the bound used."""
    from lab.analysis.equivalence import worst_gradient_error

    errors = result.relative_errors
    name, worst = worst_gradient_error(errors)
    return dict(
        worst_tensor=name,
        domino_error=worst,
        stock_error=worst_gradient_error(stock_errors)[1],
        loss_error=errors["loss"],
        stock_loss_error=stock_errors["loss"],
        limit_use=max(errors[n] / bound.limit(stock_errors[n]) for n in stock_errors),
    )


def equivalence_rank(
    cases: list[dict], device: str, quick: bool, staged: list[str]
) -> dict[str, object]:
    """Run ``cases`` on this rank; one result dict per case, plus a ``revert`` row per model.

    Entry point for :func:`~lab.launch.ranks.run_ranks` (``init="megatron"``).
    """
    from lab.analysis.equivalence import (
        RelativeErrorBound,
        compare_with_stock,
        fp32_reference_model,
        token_batch,
        tolerance_for,
    )
    from lab.gpu_check.host_staging import host_staged
    from lab.models.gpu_check_models import (
        MICRO_BATCH,
        build_on_device,
        configure_cuda_numerics,
        model_options,
    )
    from megatron_domino.base.settings import setting

    numerics = configure_cuda_numerics() if device == "cuda" else {}
    rows = []

    def model_key(case):
        return (case["dtype"], case["flavour"], setting(case["setting"]).sequence_parallel)

    with host_staged(staged, verify_on=device):
        for (dtype, flavour, sequence_parallel), group in groupby(cases, key=model_key):
            settings = {case["setting"]: setting(case["setting"]).config for case in group}
            options = model_options(
                flavour,
                quick=quick,
                bf16=dtype == "bfloat16",
                sequence_parallel=sequence_parallel,
            )
            model = build_on_device(options, device)
            batch = token_batch(options, MICRO_BATCH, device=device)
            tolerance = tolerance_for(options)
            bf16 = isinstance(tolerance, RelativeErrorBound)
            reference = fp32_reference_model(options, model) if bf16 else None
            report = compare_with_stock(model, batch, settings, tolerance, fp32_reference=reference)
            criterion = (
                str(tolerance)
                if bf16
                else f"vs stock: atol {tolerance['atol']:g}, rtol {tolerance['rtol']:g}"
            )
            where = dict(flavour=flavour, dtype=dtype)
            for name, result in report.settings.items():
                numbers = dict.fromkeys(BF16_FIELDS, None) | dict(worst_tensor=None)
                if bf16:
                    numbers |= _bf16_numbers(result, report.stock_relative_errors, tolerance)
                rows.append(
                    dict(
                        where,
                        setting=name,
                        passed=result.passed,
                        max_error=result.max_error,
                        tolerance=criterion,
                        mismatches=result.mismatches[:3],
                        mismatch_count=len(result.mismatches),
                        left_pending=result.left_pending,
                        dgrad_slots=result.dgrad_slots,
                        **numbers,
                    )
                )
                vs_fp32 = (
                    f"; vs fp32 worst gradient Domino {numbers['domino_error']:.2e}, stock "
                    f"{numbers['stock_error']:.2e}, {numbers['limit_use']:.2f} of the bound"
                    if bf16
                    else ""
                )
                _say(
                    f"{flavour} {dtype} {name}: max |Domino - stock| {result.max_error:.2e}"
                    f"{vs_fp32} -> {'ok' if result.passed else 'FAILED'}"
                )
            model_name = "sp" if sequence_parallel else "plain"
            rows.append(
                dict(
                    where,
                    setting=f"revert ({model_name})",
                    passed=report.reverted,
                    max_error=report.revert_error,
                    tolerance=f"<= stock run-to-run {report.stock_noise:.2e}",
                    mismatches=[],
                    mismatch_count=0,
                    left_pending=0,
                    dgrad_slots=0,
                    worst_tensor=None,
                    **dict.fromkeys(BF16_FIELDS, None),
                )
            )
            del model, reference
    return dict(rows=rows, numerics=numerics)


def merge_ranks(per_rank: list[dict]) -> list[dict]:
    """One row per case over all ranks: passed on every rank, the largest error of any."""
    merged = []
    for rows in zip(*(r["rows"] for r in per_rank), strict=True):
        row = dict(rows[0])
        row["passed"] = all(r["passed"] for r in rows)
        row["max_error"] = max(r["max_error"] for r in rows)
        row["mismatches"] = [m for r in rows for m in r["mismatches"]][:3]
        row["mismatch_count"] = max(r["mismatch_count"] for r in rows)
        row["left_pending"] = max(r["left_pending"] for r in rows)
        if row["domino_error"] is not None:
            for key in BF16_FIELDS:
                row[key] = max(r[key] for r in rows)
            row["worst_tensor"] = max(rows, key=lambda r: r["domino_error"])["worst_tensor"]
        merged.append(row)
    return merged


def failure(row: dict) -> str:
    """A failed row, as the part's reason names it."""
    return f"{row['flavour']} {row['dtype']} {row['setting']}"


def summary(rows: list[dict], cases: int) -> str:
    """The summary table's line: checks passed, the worst fp32 difference, the worst bf16 use
    of the bound."""
    failed = [r for r in rows if not r["passed"]]
    summary = (
        f"{len(rows) - len(failed)} of {len(rows)} checks passed ({cases} Domino cases + revert)"
    )
    fp32 = [r for r in rows if r["dtype"] == "float32" and "revert" not in r["setting"]]
    if fp32:
        worst = max(fp32, key=lambda r: r["max_error"])
        summary += (
            f"; fp32 largest |Domino - stock| {worst['max_error']:.2e} ({worst['flavour']} "
            f"{worst['setting']}, {worst['tolerance']})"
        )
    bf16 = [r for r in rows if r["domino_error"] is not None]
    if bf16:
        worst = max(bf16, key=lambda r: r["limit_use"])
        summary += (
            f"; bf16 vs fp32, worst gradient Domino {max(r['domino_error'] for r in bf16):.2e} "
            f"/ stock {max(r['stock_error'] for r in bf16):.2e}, at most "
            f"{worst['limit_use']:.2f} of the bound ({worst['flavour']} {worst['setting']}, "
            f"{worst['tolerance']})"
        )
    return summary


def table(rows: list[dict]) -> str:
    """One line per case: the difference from stock, and in bf16 the errors against fp32."""

    def pair(row: dict, domino: str, stock: str) -> str:
        return "-" if row[domino] is None else f"{row[domino]:.2e} / {row[stock]:.2e}"

    table = (
        "| model | dtype | setting | max abs diff vs stock | worst gradient vs fp32 "
        "(Domino / stock) | loss vs fp32 (Domino / stock) | share of bound | criterion | "
        "result |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    return table + "\n".join(
        f"| {r['flavour']} | {r['dtype']} | {r['setting']} | {r['max_error']:.2e} | "
        f"{pair(r, 'domino_error', 'stock_error')} | {pair(r, 'loss_error', 'stock_loss_error')} | "
        f"{'-' if r['limit_use'] is None else format(r['limit_use'], '.2f')} | {r['tolerance']} | "
        f"{'passed' if r['passed'] else 'FAILED: ' + _row_problem(r)} |"
        for r in rows
    )


def _row_problem(row: dict) -> str:
    if row["left_pending"]:
        return f"{row['left_pending']} collectives left in flight"
    if row["mismatches"]:
        return f"{row['mismatch_count']} tensors off, e.g. {row['mismatches'][0][:160]}"
    return "outside tolerance"
