"""Loss parity: train the same model twice, without and with ``--domino``, and compare losses.

    python -m lab.loss_parity                  # a tiny TP = 2 model, 30 iterations
    python -m lab.loss_parity --train-iters 100 --hidden-size 128
    python -m lab.loss_parity --domino-flags "--domino-column-chunks 2" \\
        --data-path DIR/text_document --tokenizer-type SentencePieceTokenizer \\
        --tokenizer-model DIR/tokenizer.model

(also ``python -m lab.loss_parity``). Both arms are ``torchrun
--nproc-per-node N -m megatron_domino.training`` (``pretrain_gpt_domino.py``'s body:
Megatron-LM's own ``pretrain()`` and flags) with the same flags (so the same seed, data order and initial
weights); the Domino arm adds ``--domino`` and ``--domino-flags``. Each arm's ``--log-json``
gives its per-iteration loss curve (Megatron's own log lines average over ``--log-interval``).
The defaults use Megatron-Core's local layers (``--transformer-impl local``) and, on a machine
without CUDA, the CPU replacements of Megatron-LM's other GPU defaults
(:data:`megatron_domino.training.runs.CPU_FLAGS`). Writes, under ``--output-dir`` (default
``loss_parity/``):

* ``loss_parity.json``: both curves, the largest absolute and relative difference and where,
  the flags, and the commit, versions and machine (:mod:`megatron_domino.tools.provenance`);
* ``loss_parity.png``: both curves and their difference (needs matplotlib);
* ``baseline.jsonl``/``domino.jsonl`` and ``baseline.log``/``domino.log``: each arm's records
  and output.

Training flags given here are appended to the defaults below and win over them (the last
value of a flag counts). Giving ``--data-path`` drops the default data flags (mock data,
``NullTokenizer``). ``--domino``, ``--log-json``, ``--save`` and ``--load`` are the command's
own business and are refused.

What to expect: Domino runs the same arithmetic on batch chunks, so in fp32 with dropout 0
the curves differ only by the summation order of GEMMs on smaller batches. Measured with the
defaults (30 iterations on CPU, Megatron-LM's loop, megatron-core 0.19.2, loss 6.25 -> 5.50):
at most 9.5e-7, two fp32 ulps at a loss of 5.5 (iteration 29), on 5 of 30 iterations (the
other four differences are one ulp); the other 25 are bit-identical. With dropout or bf16 expect larger differences that
stay within run-to-run noise. ``--tolerance`` turns the comparison into
a pass/fail exit status.

**With dropout** (``--dropout-seeds N``) the two curves are not equal step by step, and are
not meant to be: each of Domino's chunks draws its own dropout mask, so from iteration 1 on
the masks, and with them the losses, differ (on the default model by 3e-3 to 1.7e-2, not
growing). "The same loss curve" then means the same distribution of curves. This mode trains
each arm ``N`` times with Megatron's default dropout (``--attention-dropout 0.1
--hidden-dropout 0.1``, overridable) and seeds ``1234 .. 1234+N-1`` (the same seeds for both
arms, so the same initial weights and data per seed), and compares the curves with their
spread: per iteration, the band the stock curves span (their minimum to maximum) and each
arm's mean. It passes when the largest gap between the two means, over all iterations, is
smaller than the stock band's median width (a Domino that trained a different model drifts
away by more than the seeds differ); it also reports on how many iterations Domino's mean lies
inside the stock band (with 3 seeds the band is sometimes narrow by chance, so that count is
information, not the criterion). It writes ``loss_parity.json`` with both bands, the means
and, per iteration, whether Domino's mean was inside; exit status 1 when the check fails.
Measured with the default model, 3 seeds, 15 iterations (CPU, megatron-core 0.19.2): largest
gap between the means 4.6e-3 against a median stock band width of 3.9e-2; Domino's mean inside
the stock band on 14 of 15 iterations; iteration 1 differs per seed by 2e-4 to 2.2e-3.
``--tolerance`` (a per-step bound) does not apply and is refused there, as is ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from megatron_domino.tools.plots import pyplot, save
from megatron_domino.tools.provenance import provenance
from megatron_domino.training.runs import cpu_flags, environment, read_records, torchrun_command

ARMS = ("baseline", "domino")

GPT_MODEL_ARGS = [
    "--num-layers", "2",
    "--hidden-size", "64",
    "--num-attention-heads", "4",
    "--seq-length", "64",
    "--max-position-embeddings", "64",
    "--attention-dropout", "0",
    "--hidden-dropout", "0",
    "--transformer-impl", "local",
]  # fmt: skip
TRAINING_ARGS = [
    "--micro-batch-size", "4",
    "--global-batch-size", "8",
    "--train-iters", "30",
    "--lr", "1e-3",
    "--lr-warmup-iters", "3",
    "--log-interval", "10",
    # Megatron-LM 0.19 needs an --eval-interval; no evaluation (training losses are compared).
    "--eval-interval", "1000",
    "--eval-iters", "0",
]  # fmt: skip
MODEL_PARALLEL_ARGS = ["--tensor-model-parallel-size", "2"]


def platform_args() -> list[str]:
    """The CPU replacements of Megatron-LM's GPU defaults, on a machine without CUDA."""
    return [] if torch.cuda.is_available() else cpu_flags()


def default_data_args(output_dir: Path) -> list[str]:
    """Megatron-Core's mock dataset (sequences ``1, 2, 3, ...``: a curve that clearly falls)."""
    return [
        "--mock-data",
        "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "512",
        "--data-cache-path", str(output_dir / "data_cache"),
    ]  # fmt: skip


#: Flags the command sets itself, or that would make the arms interfere.
REFUSED = {
    "--domino": "the command adds --domino to the second arm; give Domino settings with "
    "--domino-flags",
    "--log-json": "the command writes each arm's log into --output-dir",
    "--save": "both arms would write the same checkpoints",
    "--load": "resumed runs are not compared; start both arms from scratch",
}


class LossParityError(ValueError):
    """Invalid flags, or a run whose losses cannot be compared; the message says why."""


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """The command's own flags, and the training flags (everything else)."""
    parser = argparse.ArgumentParser(
        prog="python -m lab.loss_parity",
        description="Train without and with --domino (same flags, seed and data) and compare "
        "the loss curves. Unknown flags are training flags of pretrain_gpt_domino.py, "
        "appended to a tiny TP = 2 mock-data default.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--output-dir", type=Path, default=Path("loss_parity"),
        help="Where the JSON, the plot and each arm's logs go. Default: loss_parity.",
    )  # fmt: skip
    parser.add_argument(
        "--nproc-per-node", type=int, default=2,
        help="torchrun ranks per arm. Default: 2 (the default TP).",
    )  # fmt: skip
    parser.add_argument(
        "--domino-flags", default="",
        help='Extra flags of the Domino arm only, as one string: "--domino-chunks 4", or '
        "--domino-flags=--domino-report for a single flag.",
    )  # fmt: skip
    parser.add_argument(
        "--tolerance", type=float, default=None,
        help="Exit with status 1 if the largest absolute loss difference exceeds this.",
    )  # fmt: skip
    parser.add_argument(
        "--dropout-seeds", type=int, default=0, metavar="N",
        help="With dropout on (Megatron's default 0.1): train each arm with N seeds and check "
        "that Domino's mean curve stays inside the stock seeds' band (the statistical sense of "
        "'the same loss curve'; chunks draw their own masks). Default: 0 (one run per arm, "
        "dropout off, compared step by step).",
    )  # fmt: skip
    args, training_flags = parser.parse_known_args(argv)
    if args.dropout_seeds:
        if args.dropout_seeds < 2:
            raise LossParityError(
                f"--dropout-seeds {args.dropout_seeds}: a band needs at least 2 seeds."
            )
        if args.tolerance is not None:
            raise LossParityError(
                "--tolerance bounds step-by-step differences, which dropout makes meaningless; "
                "with --dropout-seeds the check is the stock seeds' band: drop --tolerance."
            )
        if any(flag.split("=", 1)[0] == "--seed" for flag in training_flags):
            raise LossParityError(
                "--seed is not accepted with --dropout-seeds: each run gets its own "
                f"(seeds {', '.join(map(str, dropout_seeds(args.dropout_seeds)))})."
            )
    for flag in training_flags:
        name = flag.split("=", 1)[0]
        if name in REFUSED or name.startswith(("--domino-", "--no-domino-")):
            reason = REFUSED.get(
                name, "it applies to the Domino arm only; pass it in --domino-flags"
            )
            raise LossParityError(f"{name} is not accepted here: {reason}.")
    return args, training_flags


#: Megatron-LM's default dropout, which ``--dropout-seeds`` turns back on.
DROPOUT_ON = ["--attention-dropout", "0.1", "--hidden-dropout", "0.1"]


def dropout_seeds(count: int) -> list[int]:
    """The seeds of ``--dropout-seeds count``: Megatron-LM's default seed and the next ones."""
    return [1234 + i for i in range(count)]


def arm_flags(
    output_dir: Path, training_flags: list[str], domino_flags: list[str], tag: str = ""
) -> dict[str, list[str]]:
    """Each arm's full flag list: defaults, then the user's, then the arm's own; each arm's
    ``--log-json`` is ``ARM{tag}.jsonl`` in ``output_dir``."""
    names = {flag.split("=", 1)[0] for flag in training_flags}
    data = [] if "--data-path" in names else default_data_args(output_dir)
    common = [
        *platform_args(),
        *GPT_MODEL_ARGS,
        *TRAINING_ARGS,
        *MODEL_PARALLEL_ARGS,
        *data,
        *training_flags,
    ]
    return {
        "baseline": [*common, "--log-json", str(output_dir / f"baseline{tag}.jsonl")],
        "domino": [
            *common,
            "--log-json",
            str(output_dir / f"domino{tag}.jsonl"),
            "--domino",
            *domino_flags,
        ],
    }


def run_arm(name: str, command: list[str], log_path: Path) -> None:
    """Run one arm, streaming its output (prefixed) and keeping it in ``log_path``."""
    print(f"[loss-parity] {name}: {shlex.join(command)}", flush=True)
    with (
        log_path.open("w", encoding="utf-8") as log,
        subprocess.Popen(
            command, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as process,
    ):
        for line in process.stdout:
            log.write(line)
            print(f"[{name}] {line}", end="", flush=True)
    if process.returncode != 0:
        raise LossParityError(
            f"the {name} run failed with exit status {process.returncode}; its output is in "
            f"{log_path}."
        )


def read_losses(log_json: Path) -> dict[int, float]:
    """Training loss per iteration from a ``--log-json`` file."""
    return {r["iteration"]: r["loss"] for r in read_records(log_json, "train")}


def compare(baseline: dict[int, float], domino: dict[int, float]) -> dict:
    """Both curves on their common iterations and their largest differences."""
    if sorted(baseline) != sorted(domino) or not baseline:
        raise LossParityError(
            f"the arms logged different iterations (baseline {sorted(baseline)}, Domino "
            f"{sorted(domino)}): they cannot be compared."
        )
    iterations = sorted(baseline)
    diffs = [abs(baseline[i] - domino[i]) for i in iterations]
    worst = max(range(len(iterations)), key=diffs.__getitem__)
    return {
        "curves": {
            "iteration": iterations,
            "baseline": [baseline[i] for i in iterations],
            "domino": [domino[i] for i in iterations],
        },
        "max_abs_diff": diffs[worst],
        "max_abs_diff_iteration": iterations[worst],
        "max_rel_diff": max(
            d / abs(baseline[i]) for d, i in zip(diffs, iterations, strict=True) if baseline[i]
        ),
        "first_iteration_abs_diff": diffs[0],
    }


def compare_seeds(baseline: list[dict[int, float]], domino: list[dict[int, float]]) -> dict:
    """Several seeds per arm: per iteration, each arm's band (min, max) and mean, and whether
    Domino's mean lies inside the stock band; ``within_spread``: the largest gap between the
    means is below the stock band's median width (the check).

    Args:
        baseline, domino: one ``{iteration: loss}`` per seed, the same seeds in the same order.
    """
    runs = [*baseline, *domino]
    if len(baseline) != len(domino) or len(baseline) < 2 or not runs[0]:
        raise LossParityError("the seed comparison needs the same >= 2 seeds in both arms.")
    iterations = sorted(runs[0])
    if any(sorted(run) != iterations for run in runs):
        raise LossParityError("the runs logged different iterations: they cannot be compared.")

    def band(arm: list[dict[int, float]]) -> dict[str, list[float]]:
        per_iteration = [[run[i] for run in arm] for i in iterations]
        return {
            "min": [min(values) for values in per_iteration],
            "max": [max(values) for values in per_iteration],
            "mean": [sum(values) / len(values) for values in per_iteration],
        }

    stock, ours = band(baseline), band(domino)
    widths = sorted(high - low for low, high in zip(stock["min"], stock["max"], strict=True))
    max_gap = max(abs(a - b) for a, b in zip(stock["mean"], ours["mean"], strict=True))
    inside = [
        low <= mean <= high
        for low, mean, high in zip(stock["min"], ours["mean"], stock["max"], strict=True)
    ]
    paired = [
        abs(b[iterations[0]] - d[iterations[0]]) for b, d in zip(baseline, domino, strict=True)
    ]
    return {
        "iteration": iterations,
        "seeds": len(baseline),
        "baseline_band": stock,
        "domino_band": ours,
        "domino_mean_inside_baseline_band": inside,
        "inside_fraction": sum(inside) / len(inside),
        "max_mean_gap": max_gap,
        "median_baseline_band_width": widths[len(widths) // 2],
        "within_spread": max_gap < widths[len(widths) // 2],
        "first_iteration_paired_abs_diff": paired,
    }


def plot_seeds(path: Path, result: dict) -> Path | None:
    """Both arms' bands and means; None without matplotlib."""
    plt = pyplot("no loss_parity.png")
    if plt is None:
        return None
    fig, axes = plt.subplots(figsize=(7, 4))
    for arm, color in (("baseline", "#888888"), ("domino", "#4477cc")):
        band = result[f"{arm}_band"]
        axes.fill_between(result["iteration"], band["min"], band["max"], color=color, alpha=0.3)
        axes.plot(result["iteration"], band["mean"], color=color, label=f"{arm} mean")
    axes.set(
        xlabel="iteration",
        ylabel="lm loss",
        title=f"dropout on, {result['seeds']} seeds per arm: Domino's mean inside stock's band "
        f"on {result['inside_fraction']:.0%} of iterations",
    )
    axes.legend()
    return save(fig, path)


def write_results(output_dir: Path, result: dict, draw) -> None:
    """``loss_parity.json`` and the plot ``draw(path, result)`` makes; say where they went."""
    json_path = output_dir / "loss_parity.json"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    png = draw(output_dir / "loss_parity.png", result)
    print(f"[loss-parity] wrote {json_path}" + (f" and {png}" if png else ""))


def _seeds_main(args: argparse.Namespace, training_flags: list[str], domino_flags: list[str]):
    """``--dropout-seeds``: every seed through both arms; the band comparison and its status."""
    output_dir: Path = args.output_dir
    losses: dict[str, list[dict[int, float]]] = {arm: [] for arm in ARMS}
    commands = {}
    for seed in dropout_seeds(args.dropout_seeds):
        flags = arm_flags(
            output_dir, [*DROPOUT_ON, *training_flags, "--seed", str(seed)], domino_flags,
            tag=f"-seed{seed}",
        )  # fmt: skip
        for arm in ARMS:
            command = torchrun_command(args.nproc_per_node, flags[arm])
            run_arm(f"{arm} seed {seed}", command, output_dir / f"{arm}-seed{seed}.log")
            losses[arm].append(read_losses(output_dir / f"{arm}-seed{seed}.jsonl"))
            commands[f"{arm} seed {seed}"] = command
    result = {
        **compare_seeds(losses["baseline"], losses["domino"]),
        "training_flags": training_flags,
        "domino_flags": ["--domino", *domino_flags],
        "commands": commands,
        "provenance": provenance(),
    }
    print(
        f"[loss-parity] dropout on, {result['seeds']} seeds per arm, "
        f"{len(result['iteration'])} iterations: Domino's mean curve inside the stock seeds' "
        f"band on {result['inside_fraction']:.0%} of iterations; largest gap between the means "
        f"{result['max_mean_gap']:.3e} (stock band median width "
        f"{result['median_baseline_band_width']:.3e}); iteration 1 differs per seed by "
        + ", ".join(f"{d:.1e}" for d in result["first_iteration_paired_abs_diff"])
    )
    write_results(output_dir, result, plot_seeds)
    if not result["within_spread"]:
        print(
            "[loss-parity] FAILED: the means drift apart by more than the stock seeds' spread",
            file=sys.stderr,
        )
        return 1
    return 0


def plot(path: Path, result: dict) -> Path | None:
    """Both loss curves, and their absolute difference on a log scale; None without matplotlib."""
    plt = pyplot("no loss_parity.png")
    if plt is None:
        return None
    curves = result["curves"]
    fig, (losses, diffs) = plt.subplots(1, 2, figsize=(11, 4))
    losses.plot(curves["iteration"], curves["baseline"], color="#888888", lw=2.5, label="baseline")
    losses.plot(curves["iteration"], curves["domino"], color="#4477cc", ls="--", label="--domino")
    losses.set(xlabel="iteration", ylabel="lm loss", title="training loss")
    losses.legend()
    difference = [abs(b - d) for b, d in zip(curves["baseline"], curves["domino"], strict=True)]
    differing = [(i, d) for i, d in zip(curves["iteration"], difference, strict=True) if d > 0]
    identical = len(difference) - len(differing)
    if differing:
        diffs.plot(*zip(*differing, strict=True), "o", color="#cc4444")
        diffs.set(yscale="log")
    else:
        diffs.text(
            0.5, 0.5, "every iteration bit-identical", ha="center", transform=diffs.transAxes
        )
    diffs.set(
        xlim=(curves["iteration"][0] - 1, curves["iteration"][-1] + 1),
        xlabel="iteration",
        ylabel="|baseline - domino| (where nonzero)",
        title=f"max {result['max_abs_diff']:.2e}; {identical} of {len(difference)} "
        "iterations bit-identical",
    )
    fig.suptitle("loss parity: " + " ".join(result["domino_flags"] or ["--domino"]))
    return save(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    """Run both arms and write the comparison; returns the exit status."""
    try:
        args, training_flags = parse_args(sys.argv[1:] if argv is None else list(argv))
        domino_flags = shlex.split(args.domino_flags)
        output_dir: Path = args.output_dir
        output_dir.mkdir(parents=True, exist_ok=True)
        if args.dropout_seeds:
            return _seeds_main(args, training_flags, domino_flags)
        flags = arm_flags(output_dir, training_flags, domino_flags)
        for arm in ARMS:
            run_arm(
                arm, torchrun_command(args.nproc_per_node, flags[arm]), output_dir / f"{arm}.log"
            )
        result = {
            **compare(*(read_losses(output_dir / f"{arm}.jsonl") for arm in ARMS)),
            "tolerance": args.tolerance,
            "training_flags": training_flags,
            "domino_flags": ["--domino", *domino_flags],
            "commands": {arm: torchrun_command(args.nproc_per_node, flags[arm]) for arm in ARMS},
            "provenance": provenance(),
        }
    except LossParityError as err:
        print(f"[loss-parity] error: {err}", file=sys.stderr)
        return 2
    within = args.tolerance is None or result["max_abs_diff"] <= args.tolerance
    result["within_tolerance"] = None if args.tolerance is None else within
    print(
        f"[loss-parity] {len(result['curves']['iteration'])} iterations: max |loss difference| "
        f"{result['max_abs_diff']:.3e} at iteration {result['max_abs_diff_iteration']} "
        f"(relative {result['max_rel_diff']:.2e}); final loss baseline "
        f"{result['curves']['baseline'][-1]:.6f}, Domino {result['curves']['domino'][-1]:.6f}"
    )
    write_results(output_dir, result, plot)
    if not within:
        print(
            f"[loss-parity] FAILED: {result['max_abs_diff']:.3e} > --tolerance "
            f"{args.tolerance:.3e}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
