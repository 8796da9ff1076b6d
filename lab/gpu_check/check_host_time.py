"""Part 5: is a Domino layer launch-bound at a real per-rank shape? Host time vs device time.

Domino issues each layer's kernels once per chunk. This part measures, per layer, the host
time of the transformer block's forward and backward (``perf_counter``, the device running
alongside) and the device time of the same work (CUDA events, the step queued behind a
sleep so the device never waits for the host): :mod:`lab.analysis.host_time`.
Stock, ``p2`` and ``s2``, with every tensor-parallel collective a no-op
(:mod:`lab.bench.noop_collectives`): this is the host cost of chunking
alone. A row is **launch-bound** when its host time is at least its device time: the device
would then wait for the host.

The shape is one rank's of Llama-3-8B at TP = 8 (``h = 4096``, 32 heads, MLP 14336, ``s =
4096``), micro-batch 1 and 2, bf16, four layers: built at TP = 2 with a quarter of the heads
and MLP width, so each rank's GEMMs have the TP = 8 widths. Two ranks start (TP = 2 needs
them); rank 0 measures, rank 1 only waits, so the GPU is not shared while timing. Differences
from that model, stated: multi-head attention (8 heads, 4 per rank; Llama's grouped queries
would make QKV half as wide) and Megatron-Core's local attention (unfused softmax: more
device time than a fused kernel, which makes the launch-bound verdict *lenient*). With
``--device cpu`` the shape is tiny and only the host time exists (the wall clock of the whole
computation): no verdict.
"""

from __future__ import annotations

import time

from lab.bench.host_time import with_ratios
from lab.gpu_check import markdown
from lab.gpu_check.results import Part, PartResult
from lab.models.model_options import LLAMA_FLAVOUR

__all__ = ["ARMS", "model_fields", "run_part"]

PART = Part(
    "host",
    "5. host time vs device time per layer (no-op collectives)",
    "lab.bench.host_time:host_time_rank",
)
#: Arms per micro-batch: the batch split needs b divisible by p.
ARMS = {1: ("stock", "s2"), 2: ("stock", "p2", "s2")}
LAYERS = 4
#: (hidden, heads, MLP width, sequence) at TP = 2; per rank the TP = 8 widths of Llama-3-8B.
SHAPES = {"cuda": (4096, 8, 3584, 4096), "cpu": (128, 4, 256, 64)}


def model_fields(device: str) -> dict:
    """:class:`~lab.models.model_options.GPTOptions` fields of the measured model
    on ``device`` (module docstring)."""
    hidden, heads, ffn, seq = SHAPES[device]
    return dict(
        num_layers=LAYERS,
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=ffn,
        seq_length=seq,
        vocab_size=1024,
        **LLAMA_FLAVOUR,
        bf16=device == "cuda",
    )


def _verdict(row: dict) -> str:
    if row["device_ms"] is None:
        return "n/a (CPU: host only)"
    if row["host_ms"] >= row["device_ms"]:
        return "launch-bound"
    return f"not launch-bound (host {row['host_ms'] / row['device_ms']:.0%} of device)"


def _table(rows: list[dict]) -> str:
    header = ("b", "arm", "host ms/layer", "vs stock", "device ms/layer", "aten ops/layer",
              "verdict")  # fmt: skip
    return markdown.table(
        header,
        (
            (r["micro_batch"], r["arm"], f"{r['host_ms']:.3f}", f"{r['host_vs_stock']:.2f}x",
             "n/a" if r["device_ms"] is None else f"{r['device_ms']:.3f}",
             f"{r['aten_ops']:.0f}", r["verdict"])
            for r in rows
        ),
    )  # fmt: skip


def run_part(device: str, quick: bool, budget_s: float) -> PartResult:
    """The part, as the check's parent runs it (two spawned ranks within ``budget_s``)."""
    from lab.gpu_check.parts import model_parts_unavailable, run_part_ranks

    unavailable = model_parts_unavailable()
    if unavailable:
        return PART.skipped(unavailable, budget_s)
    start = time.monotonic()
    warmup, iters = (2, 5) if quick or device == "cpu" else (3, 10)
    args = (device, model_fields(device), ARMS, warmup, iters)
    per_rank, failed_part = run_part_ranks(PART, budget_s=budget_s, device=device, args=args)
    if failed_part is not None:
        return failed_part
    rows = with_ratios(per_rank[0]["rows"])
    for row in rows:
        row["verdict"] = _verdict(row)
    bound = [f"b={r['micro_batch']} {r['arm']}" for r in rows if r["verdict"] == "launch-bound"]
    hidden, _, _, seq = SHAPES[device]
    if device == "cuda":
        summary = (
            f"h={hidden} s={seq}, TP 8 widths: "
            + ("launch-bound: " + ", ".join(bound) if bound else "no arm launch-bound")
            + "; "
            + ", ".join(
                f"b={r['micro_batch']} {r['arm']} {r['host_ms']:.2f}/{r['device_ms']:.2f} ms"
                for r in rows
            )
            + " (host/device per layer)"
        )
        notes = [
            "device time from the step queued behind a sleep kernel; local (unfused) attention "
            "and multi-head QKV make it larger than a TE Llama-3-8B layer's, so the verdict is "
            "lenient."
        ]
    else:
        summary = f"tiny shape (h={hidden} s={seq}); host ms/layer: " + ", ".join(
            f"b={r['micro_batch']} {r['arm']} {r['host_ms']:.2f} ({r['host_vs_stock']:.2f}x)"
            for r in rows
        )
        notes = ["CPU stand-in: no device time and no launch-bound verdict; host time is wall."]
    return PART.result(
        "passed",
        summary,
        budget_s,
        start=start,
        notes=notes,
        details={"rows": rows, "options": per_rank[0]["options"], "layers": LAYERS},
        table=_table(rows),
    )
