"""``python -m lab.gpu_check``: the one-command GPU check, and its flags.

Runs, each within a time budget and printing progress: the gloo probe (part 0), Domino vs
unpatched Megatron-Core on the device (part 1), the recorded schedule's structure (part 2),
the GEMM-efficiency table (part 3), Domino's in-flight collectives on one NCCL process (part
4), host time against device time per layer (part 5) and a Domino step captured in a CUDA
graph and replayed (part 6: CUDA only and opt-in, ``--parts capture``, since the default
parts fill the lent machine's lease; skipped on the CPU); then writes ``results.json`` and
``summary.md`` into a new directory under ``--out-dir`` (``latest`` points at it), or into
``--run-dir`` itself, and prints the detail tables and, last, the summary table.

Exit status: 0 when every part ran and passed; 1 when a part failed; 2 when the requested
device is missing; 3 when nothing failed but a part or a case inside one was skipped (a
missing package, a collective gloo lacks under ``--host-staging never``, part 6 asked for on
the CPU): a skip means the check is incomplete, and it says which and
why in the summary's Overall line (:func:`~lab.gpu_check.results.verdict`).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

from lab.gpu_check import (
    check_capture,
    check_host_time,
    check_inflight,
    gemm,
    parts,
)
from lab.gpu_check.results import (
    EXIT_STATUS,
    environment,
    summary_table,
    verdict,
    write_results,
)

__all__ = [
    "DEFAULT_BUDGETS_S",
    "PARTS",
    "QUICK_BUDGETS_S",
    "STANDALONE_PARTS",
    "main",
    "parse_args",
]

#: Parts that take only the device, ``--quick`` and their budget, run in this order after the
#: four below: one line each registers a part.
STANDALONE_PARTS = {
    "inflight": check_inflight.run_part,
    "host": check_host_time.run_part,
    "capture": check_capture.run_part,
}
PARTS = ("probe", "equivalence", "overlap", "gemm", *STANDALONE_PARTS)
#: Run only when asked for (``--parts capture``): the default parts fill the lent machine's
#: lease, and the capture needs CUDA (on ``--device cpu`` it is skipped: "needs CUDA").
OPT_IN_PARTS = ("capture",)
DEFAULT_PARTS = tuple(part for part in PARTS if part not in OPT_IN_PARTS)
#: Seconds per part on CUDA. Full: 450 s together, under 8 minutes with the start-up and the
#: wheel install of ``scripts/gpu_check_offline.sh``; ``--quick``: 210 s, under 4. Typical use
#: is far below (docs/gpu_check.md). ``--device cpu`` takes the full budgets either way: the
#: CPU stand-in is slower than a GPU, and the minutes that matter are the lent machine's.
DEFAULT_BUDGETS_S = {
    "probe": 45.0,
    "equivalence": 120.0,
    "overlap": 75.0,
    "gemm": 90.0,
    "inflight": 30.0,
    "host": 90.0,
    "capture": 60.0,
}
QUICK_BUDGETS_S = {
    "probe": 25.0,
    "equivalence": 65.0,
    "overlap": 40.0,
    "gemm": 15.0,
    "inflight": 20.0,
    "host": 45.0,
    "capture": 45.0,
}
NO_CUDA = "no CUDA device: the GPU check needs one"


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from error
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _parts(text: str) -> tuple[str, ...]:
    chosen = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [p for p in chosen if p not in PARTS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(
            f"unknown part(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(PARTS)}"
        )
    return chosen


def _budget(text: str) -> tuple[str, float]:
    part, _, seconds = text.partition("=")
    if part not in PARTS:
        raise argparse.ArgumentTypeError(f"--budget PART=SECONDS with PART in {', '.join(PARTS)}")
    try:
        value = float(seconds)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"--budget {text}: SECONDS must be a number") from error
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--budget {text}: SECONDS must be > 0")
    return part, value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m lab.gpu_check",
        description="Domino on one GPU: equivalence with Megatron-Core (TP=2 as two processes "
        "over gloo), the recorded overlap structure with CUDA events, and GEMM efficiency "
        "per chunking. Prints a Markdown summary table last.",
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cuda (the check); cpu runs the same code paths on the CPU with gloo, fp32, tiny "
        "shapes and wall-clock times, to test the script without a GPU. Default: cuda.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="Smaller models (the test suite's sizes), one model flavour and one GEMM shape.",
    )
    parser.add_argument(
        "--parts",
        type=_parts,
        default=DEFAULT_PARTS,
        help=f"Comma-separated parts to run, from {','.join(PARTS)} (the probe also runs "
        f"whenever equivalence or overlap does). Default: {','.join(DEFAULT_PARTS)}.",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=Path("gpu_check_results"),
        help="Each run writes results.json and summary.md into a new directory here; "
        "OUT_DIR/latest links to it. Default: gpu_check_results.",
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="Write results.json and summary.md into exactly this directory instead (created; "
        "it must not exist or be empty), with no latest link: for a folder that is copied "
        "back, e.g. $OUT on a lent machine.",
    )
    parser.add_argument(
        "--host-staging",
        choices=("auto", "never", "always"),
        default="auto",
        help="What to do about collectives gloo cannot run on device tensors: auto stages "
        "those the probe did not confirm through host memory (a test-only shim, reported in "
        "the summary); never skips the cases that need them, with the reason (the run is then "
        "incomplete, exit status 3); always stages every collective (tests the shim). "
        "Default: auto.",
    )
    parser.add_argument(
        "--budget",
        type=_budget,
        action="append",
        default=[],
        metavar="PART=SECONDS",
        help="Time budget of one part (repeatable). Defaults: "
        + ", ".join(f"{k}={v:.0f}" for k, v in DEFAULT_BUDGETS_S.items())
        + "; with --quick on cuda: "
        + ", ".join(f"{k}={v:.0f}" for k, v in QUICK_BUDGETS_S.items())
        + ". Model parts past their budget are killed and fail; the GEMM part stops starting "
        "configurations and says how many it left out.",
    )
    shapes = parser.add_argument_group(
        "GEMM shapes", "Override the preset's shape set (comma-separated integers)."
    )
    shapes.add_argument(
        "--gemm-preset",
        choices=tuple(gemm.PRESETS),
        default=None,
        help="paper: h 4096,8192 x b 4,8,16 x s 512,1024,2048 at TP 8, p and k in 1,2,4 "
        "(162 configurations); quick: h 4096, b 4, s 1024; cpu: tiny. Default: paper on cuda, "
        "quick with --quick, cpu with --device cpu.",
    )
    for name, help_text in (
        ("hidden", "hidden sizes h"),
        ("micro-batch", "micro-batch sizes b"),
        ("seq", "sequence lengths s"),
        ("tp", "tensor-parallel sizes (per-rank widths h/TP, 3h/TP, 4h/TP)"),
        ("chunks", "row chunks p (must divide b)"),
        ("column-chunks", "column pieces k of the row-parallel GEMMs (must divide h)"),
    ):
        shapes.add_argument(f"--gemm-{name}", type=_int_list, default=None, help=help_text)
    shapes.add_argument(
        "--gemm-warmup", type=int, default=None, help="Untimed iterations (default 3; cpu 1)."
    )
    shapes.add_argument(
        "--gemm-iters", type=int, default=None, help="Timed iterations (default 10; cpu 2)."
    )
    args = parser.parse_args(argv)
    if args.run_dir is not None and args.run_dir.exists():
        if not args.run_dir.is_dir() or any(args.run_dir.iterdir()):
            parser.error(
                f"--run-dir {args.run_dir} exists and is not an empty directory: name a new "
                "one (results are never written over an earlier run's)."
            )
    return args


def gemm_spec(args: argparse.Namespace) -> dict[str, tuple[int, ...]]:
    """The preset for ``--device``/``--quick`` (or ``--gemm-preset``), with overrides."""
    preset = args.gemm_preset or (
        "cpu" if args.device == "cpu" else "quick" if args.quick else "paper"
    )
    spec = dict(gemm.PRESETS[preset])
    for key in ("hidden", "micro_batch", "seq", "tp", "chunks", "column_chunks"):
        override = getattr(args, f"gemm_{key}")
        if override is not None:
            spec[key] = override
    return spec


def _link_latest(out_dir: Path, run_dir: Path) -> None:
    latest = out_dir / "latest"
    try:
        if latest.is_symlink() or latest.exists():
            latest.unlink()
        latest.symlink_to(run_dir.name)
    except OSError:
        pass  # a file system without links: the printed path is enough


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"{NO_CUDA} (torch {torch.__version__}: torch.cuda.is_available() is False). "
            "To test this script's logic on the CPU: python -m lab.gpu_check "
            "--device cpu --quick",
            file=sys.stderr,
        )
        return 2
    if args.device == "cpu":
        # The CPU path must not touch a GPU even where one exists (the CPU runtime refuses).
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    for part in OPT_IN_PARTS:
        if part not in args.parts:
            parts.say(f"{part}: not run (opt-in, needs CUDA): add --parts {part} on a GPU")
    quick_budgets = args.quick and args.device == "cuda"
    budgets = dict(QUICK_BUDGETS_S if quick_budgets else DEFAULT_BUDGETS_S, **dict(args.budget))
    env = environment(args.device)
    run_dir = args.run_dir
    if run_dir is None:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
        run_dir = args.out_dir / f"{stamp}-{args.device}{'-quick' if args.quick else ''}"
        for attempt in range(2, 100):  # two runs within one second get their own directories
            if not run_dir.exists():
                break
            run_dir = run_dir.with_name(f"{run_dir.name.split('.')[0]}.{attempt}")
    parts.say(
        f"{env['gpu'] or 'CPU'}, torch {env['torch']}, megatron-core {env['megatron-core']}; "
        f"parts: {', '.join(args.parts)}; results -> {run_dir}"
    )
    results = []
    supported: dict[str, bool | None] = {}
    if {"probe", "equivalence", "overlap"} & set(args.parts):
        probe_part, supported = parts.run_probe(args.device, budgets["probe"])
        results.append(probe_part)
    collectives = parts.staging_plan(supported, args.host_staging)
    if "equivalence" in args.parts:
        results.append(
            parts.run_equivalence(args.device, args.quick, collectives, budgets["equivalence"])
        )
    if "overlap" in args.parts:
        results.append(parts.run_overlap(args.device, args.quick, collectives, budgets["overlap"]))
    if "gemm" in args.parts:
        cpu = args.device == "cpu"
        results.append(
            parts.run_gemm(
                args.device,
                gemm_spec(args),
                budgets["gemm"],
                warmup=args.gemm_warmup if args.gemm_warmup is not None else (1 if cpu else 3),
                iters=args.gemm_iters if args.gemm_iters is not None else (2 if cpu else 10),
            )
        )
    for name, run_part in STANDALONE_PARTS.items():
        if name in args.parts:
            parts.say(f"{name}: on {args.device}, budget {budgets[name]:.0f} s")
            results.append(run_part(args.device, args.quick, budgets[name]))
    write_results(run_dir, env, results, sys.argv if argv is None else list(argv))
    if args.run_dir is None:
        _link_latest(args.out_dir, run_dir)
    for part in results:
        if part.table:
            print(f"\n### {part.title}\n\n{part.table}")
    print("\n" + summary_table(env, results, run_dir), flush=True)
    return EXIT_STATUS[verdict(results)[0]]
