"""Part 1: Domino computes what unpatched Megatron-Core computes, on the device, at TP = 2.

Two ranks (two processes sharing the GPU, gloo) build each model once, then
:func:`megatron_domino.equivalence.compare_with_stock` (the comparison the CPU test suite
makes) runs the stock block, Domino for each setting, and stock again after ``revert``:
per-token loss and every gradient within :data:`megatron_domino.equivalence.TOLERANCES`, no
collective left in flight, and the reverted model reproducing the reference up to the
run-to-run difference of two stock runs.

Cases are (flavour, dtype, setting): ``p2`` and ``p2-k2`` on the plain model, ``sp-p2`` on the
same model with ``--sequence-parallel``. The parent plans them (:func:`plan`) and drops the
ones whose collectives gloo cannot run here when host staging is off.
"""

from __future__ import annotations

from itertools import groupby

__all__ = ["CASE_SETTINGS", "equivalence_rank", "merge_ranks", "plan"]

#: Settings compared, by model kind (see :data:`megatron_domino.gpu_check.models.SETTINGS`).
CASE_SETTINGS = ("p2", "p2-k2", "s2", "sp-p2")


def plan(*, device: str, quick: bool) -> list[dict]:
    """The cases to run: fp32 on the CPU; bf16 and fp32 on CUDA; ``llama`` only with --quick."""
    dtypes = ["float32"] if device == "cpu" else ["bfloat16", "float32"]
    flavours = ["llama"] if quick else ["gpt", "llama"]
    return [
        dict(flavour=flavour, dtype=dtype, setting=setting)
        for dtype in dtypes
        for flavour in flavours
        for setting in CASE_SETTINGS
    ]


def _say(message: str) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(f"[gpu_check rank 0] equivalence {message}", flush=True)


def equivalence_rank(
    cases: list[dict], device: str, quick: bool, staged: list[str]
) -> dict[str, object]:
    """Run ``cases`` on this rank; one result dict per case, plus a ``revert`` row per model.

    Entry point for :func:`~megatron_domino.ranks.run_ranks` (``init="megatron"``).
    """
    from megatron_domino.equivalence import compare_with_stock, token_batch, tolerance_for
    from megatron_domino.gpu_check.host_staging import host_staged
    from megatron_domino.gpu_check.models import (
        MICRO_BATCH,
        build_on_device,
        configure_cuda_numerics,
        domino_config,
        model_options,
    )

    numerics = configure_cuda_numerics() if device == "cuda" else {}
    rows = []

    def model_key(case):
        return (case["dtype"], case["flavour"], domino_config(case["setting"])[1])

    with host_staged(staged, verify_on=device):
        for (dtype, flavour, sequence_parallel), group in groupby(cases, key=model_key):
            settings = {case["setting"]: domino_config(case["setting"])[0] for case in group}
            options = model_options(
                flavour,
                quick=quick,
                bf16=dtype == "bfloat16",
                sequence_parallel=sequence_parallel,
            )
            model = build_on_device(options, device)
            batch = token_batch(options, MICRO_BATCH, device=device)
            tolerance = tolerance_for(options)
            report = compare_with_stock(model, batch, settings, tolerance)
            where = dict(flavour=flavour, dtype=dtype)
            for name, result in report.settings.items():
                rows.append(
                    dict(
                        where,
                        setting=name,
                        passed=result.passed,
                        max_error=result.max_error,
                        tolerance=f"atol {tolerance['atol']:g}, rtol {tolerance['rtol']:g}",
                        mismatches=result.mismatches[:3],
                        mismatch_count=len(result.mismatches),
                        left_pending=result.left_pending,
                        dgrad_slots=result.dgrad_slots,
                    )
                )
                _say(
                    f"{flavour} {dtype} {name}: max |diff| {result.max_error:.2e} "
                    f"({rows[-1]['tolerance']}) -> {'ok' if result.passed else 'FAILED'}"
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
                )
            )
            del model
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
        merged.append(row)
    return merged
