"""The host-time row of ``make bench``: what chunking costs the host, per layer.

Domino runs each layer's Python and kernels once per chunk. With tiny tensors and every
tensor-parallel collective a no-op (:mod:`lab.bench.noop_collectives`),
a step's wall time is the host's time (dispatch, autograd, Domino's bookkeeping), the cost a
GPU run pays on its CPU whatever the kernels take. Per layer, forward and backward of the
transformer block (:func:`lab.analysis.host_time.block_step`): the median host
milliseconds over round-robin iterations (every arm once per round, so slow drift of a shared
machine hits every arm alike) and the aten operators dispatched, stock against each setting.

Two ranks start (Megatron-Core's TP = 2); rank 0 measures while rank 1 only waits, since a
no-op collective needs no peer. :func:`host_time_rank` is also the GPU check's part 5
(:mod:`lab.gpu_check.check_host_time`), at a real per-rank shape there.
"""

from __future__ import annotations

import statistics

from lab.bench.cases import SETTINGS
from lab.models.model_options import LLAMA_FLAVOUR

__all__ = ["HOST_MODEL", "host_table", "host_time_rank", "main", "measure_host_time", "with_ratios"]

#: Tiny Llama-style layers at TP = 2: compute is negligible next to the host's work.
HOST_MODEL = dict(
    num_layers=8, hidden_size=64, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=96,
    seq_length=16, vocab_size=256, **LLAMA_FLAVOUR,
)  # fmt: skip
HOST_MICRO_BATCH = 4


def host_time_rank(
    device: str, model: dict, arms_by_micro_batch: dict, warmup: int, iters: int
) -> dict | None:
    """Entry point for :func:`~lab.launch.ranks.run_ranks` (``init="megatron"``,
    TP = 2). ``model``: :class:`~lab.models.model_options.GPTOptions` fields;
    ``arms_by_micro_batch``: ``{b: ["stock", setting name, ...]}``. Rank 0 returns ``{"rows": [...], "options": model}``, one row per
    (b, arm) with per-layer ``host_ms`` (median), ``device_ms`` and ``queued_host_ms`` (CUDA
    only, else ``None``) and ``aten_ops``; rank 1 returns ``None`` at once."""
    import torch
    from megatron.core import parallel_state

    from lab.analysis.host_time import block_step, dispatched_ops, time_step
    from lab.bench.noop_collectives import tp_collectives_skipped
    from lab.models.gpt_model import GPTOptions
    from lab.models.gpu_check_models import build_on_device

    if parallel_state.get_tensor_model_parallel_rank() != 0:
        return None  # nothing below calls a collective: rank 0 times alone
    cuda = device == "cuda"
    built = build_on_device(GPTOptions(**model), device)
    layers = model["num_layers"]
    samples: dict[tuple[int, str], list] = {}
    ops: dict[tuple[int, str], int] = {}
    with tp_collectives_skipped(parallel_state.get_tensor_model_parallel_group()):
        for micro_batch, arms in arms_by_micro_batch.items():
            step = block_step(built, micro_batch)
            for round_index in range(iters):
                for arm in arms:  # round-robin: drift of a shared machine hits every arm
                    with _arm(built, arm):
                        first = round_index == 0
                        times = time_step(step, cuda=cuda, warmup=warmup if first else 0, iters=1)
                        if first:
                            ops[(micro_batch, arm)] = dispatched_ops(step)
                    samples.setdefault((micro_batch, arm), []).append(times)
            del step
            if cuda:
                torch.cuda.empty_cache()
    rows = []
    for (micro_batch, arm), runs in samples.items():
        device_ms = [t.device_ms for t in runs if t.device_ms is not None]
        queued_ms = [t.queued_host_ms for t in runs if t.queued_host_ms is not None]
        rows.append(
            dict(
                micro_batch=micro_batch,
                arm=arm,
                host_ms=statistics.median(t.host_ms for t in runs) / layers,
                device_ms=statistics.median(device_ms) / layers if device_ms else None,
                queued_host_ms=statistics.median(queued_ms) / layers if queued_ms else None,
                aten_ops=ops[(micro_batch, arm)] / layers,
            )
        )
    return {"rows": rows, "options": model}


def _arm(model, arm: str):
    """Stock as built, or Domino applied with the setting ``arm`` names."""
    import contextlib

    from megatron_domino.apply import apply_domino
    from megatron_domino.base.settings import setting

    return contextlib.nullcontext() if arm == "stock" else apply_domino(model, setting(arm).config)


def with_ratios(rows: list[dict]) -> list[dict]:
    """``rows`` with ``host_vs_stock`` and ``ops_vs_stock``: each arm over stock's at its b."""
    stock = {r["micro_batch"]: r for r in rows if r["arm"] == "stock"}
    for row in rows:
        base = stock[row["micro_batch"]]
        row["host_vs_stock"] = row["host_ms"] / base["host_ms"]
        row["ops_vs_stock"] = row["aten_ops"] / base["aten_ops"]
    return rows


def measure_host_time(settings: list[str], *, iters: int, warmup: int = 2) -> dict:
    """The bench's host row: stock and each of ``settings`` on :data:`HOST_MODEL`, CPU ranks."""
    from lab.launch.ranks import run_ranks

    arms = {HOST_MICRO_BATCH: ["stock", *settings]}
    result = run_ranks(
        "lab.bench.host_time:host_time_rank",
        2,
        device="cpu",
        args=("cpu", HOST_MODEL, arms, warmup, iters),
        timeout_s=600,
    )[0]
    return {
        "model": HOST_MODEL,
        "micro_batch": HOST_MICRO_BATCH,
        "iters": iters,
        "note": "tiny tensors, no-op TP collectives: wall time is host time; medians over "
        "round-robin iterations on a shared, noisy machine",
        "rows": with_ratios(result["rows"]),
    }


def host_table(host: dict | None) -> str:
    """The Markdown host-time table (empty without a host measurement)."""
    if not host:
        return ""
    model = host["model"]
    lines = [
        "",
        f"Host time per layer, forward + backward (TP 2, {model['num_layers']} Llama-style "
        f"layers h={model['hidden_size']} s={model['seq_length']} b={host['micro_batch']}, "
        f"{host['note']}; median of {host['iters']}):",
        "",
        "| arm | host ms/layer | vs stock | aten ops/layer | vs stock |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['arm']} | {r['host_ms']:.3f} | {r['host_vs_stock']:.2f}x | {r['aten_ops']:.0f} "
        f"| {r['ops_vs_stock']:.2f}x |"
        for r in host["rows"]
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m lab.bench.host_time [--iters N]``: the host row alone."""
    import argparse

    parser = argparse.ArgumentParser(description="The bench's host-time row alone.")
    parser.add_argument("--iters", type=int, default=20, help="Round-robin rounds (median).")
    args = parser.parse_args(argv)
    print(host_table(measure_host_time(list(SETTINGS), iters=args.iters)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
