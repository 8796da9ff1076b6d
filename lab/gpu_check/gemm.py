"""Part 3: what chunking costs in GEMM efficiency, for the paper's layer shapes.

Domino turns each of a layer's GEMMs into smaller ones: ``p`` row chunks give GEMMs with
``b s / p`` rows instead of ``b s``, and ``k`` column pieces split the row-parallel GEMMs
(attention projection, fc2) into ``k`` GEMMs of width ``h / k``. Small GEMMs run below the
device's peak, and that loss is paid whether or not there is communication to hide. This part
times, per rank at tensor parallelism TP (default 8, the paper's), the four GEMMs of one
GPT-3-style layer (MLP width 4h, multi-head attention), as Megatron-Core's local linears run
them (``y = x W^T``):

==========  =========================  ==================  ==========
GEMM        input ``x``                weight ``W``         split by
==========  =========================  ==================  ==========
QKV         ``[b s / p, h]``           ``[3h / TP, h]``     p
proj        ``[b s / p, h / TP]``      ``[h / k, h / TP]``  p, k
fc1         ``[b s / p, h]``           ``[4h / TP, h]``     p
fc2         ``[b s / p, 4h / TP]``     ``[h / k, 4h / TP]`` p, k
==========  =========================  ==================  ==========

and, for the backward, each GEMM's input gradient (``dx = dy W``, the ``k`` pieces accumulated)
and weight gradient. Each configuration's TFLOP/s (2 m n k per GEMM; the FLOPs do not depend
on p and k) is compared with ``p = 1, k = 1`` of the same shape: a ratio below 1 is the
chunking overhead that the hidden communication has to pay for. What Domino runs beside the
GEMMs is timed with them, as it runs it:

* **forward**: with ``k > 1`` each row-parallel GEMM's ``k`` piece outputs ``[s, b/p, h/k]``
  are concatenated into ``[s, b/p, h]`` once reduced (``row_output.PendingReduce.wait``);
* **backward, fused** (``bwd``: ``--gradient-accumulation-fusion``, Megatron-LM's default):
  ``dW += dy^T x`` straight into the weight's ``main_grad`` for every chunk, a piece into its
  rows (``column_pieces.py``); the placeholder gradient Domino's ``p k`` calls return is kept
  once per weight (``placeholder_grads.py``), so no placeholder is added;
* **backward, autograd** (``bwd autograd``: fusion off): each chunk's ``dW`` is a new tensor
  that autograd sums into the weight's gradient (``p - 1`` weight-sized additions), and with
  ``k > 1`` each piece's ``dW_r`` ``[h/k, n]`` reaches the weight through the slice's
  backward, zero-padded to a whole ``[h, n]`` (``k`` weight-sized zero fills and additions
  per chunk);
* **the chunk copy** (its own column): the batch split's ``[s, b/p, h]`` slice of ``[s, b,
  h]`` made contiguous (``chunking.make_chunks``), once per block and chunk, not per layer.

On CUDA the times come from CUDA events around the GEMMs (bf16); with ``--device cpu`` from
the wall clock (fp32), which is only good for testing this code.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

__all__ = ["GemmShape", "PRESETS", "configurations", "gemm_table", "time_configurations"]

GEMMS = ("qkv", "proj", "fc1", "fc2")


@dataclass(frozen=True)
class GemmShape:
    """One layer shape: hidden size h, micro-batch b, sequence s, tensor parallelism TP."""

    hidden: int
    micro_batch: int
    seq: int
    tp: int

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq

    def linears(self) -> dict[str, tuple[int, int, bool]]:
        """Per GEMM: (in features, out features, split into column pieces) on one rank."""
        h, tp = self.hidden, self.tp
        return {
            "qkv": (h, 3 * h // tp, False),
            "proj": (h // tp, h, True),
            "fc1": (h, 4 * h // tp, False),
            "fc2": (4 * h // tp, h, True),
        }


#: Shape sets: hidden sizes, micro-batches, sequence lengths, TP, chunks p, column pieces k.
PRESETS: dict[str, dict[str, tuple[int, ...]]] = {
    # The Domino paper's GPT-3 shapes at TP = 8 (per-rank widths h / 8, 3h / 8, 4h / 8).
    "paper": dict(
        hidden=(4096, 8192),
        micro_batch=(4, 8, 16),
        seq=(512, 1024, 2048),
        tp=(8,),
        chunks=(1, 2, 4),
        column_chunks=(1, 2, 4),
    ),
    # --quick on a GPU: one paper shape, every split.
    "quick": dict(
        hidden=(4096,),
        micro_batch=(4,),
        seq=(1024,),
        tp=(8,),
        chunks=(1, 2, 4),
        column_chunks=(1, 2, 4),
    ),
    # --device cpu: tiny, only to exercise this code without a GPU.
    "cpu": dict(
        hidden=(256,), micro_batch=(4,), seq=(32,), tp=(2,), chunks=(1, 2), column_chunks=(1, 2)
    ),
}


@dataclass(frozen=True)
class GemmConfig:
    shape: GemmShape
    chunks: int
    column_chunks: int


def configurations(spec: dict[str, tuple[int, ...]]) -> list[GemmConfig]:
    """Every (shape, p, k) of ``spec`` that divides evenly, ``p = k = 1`` first per shape.

    Raises:
        ValueError: a shape or split that does not divide (the message names it).
    """
    configs = []
    for hidden in spec["hidden"]:
        for micro_batch in spec["micro_batch"]:
            for seq in spec["seq"]:
                for tp in spec["tp"]:
                    shape = GemmShape(hidden, micro_batch, seq, tp)
                    if hidden % tp:
                        raise ValueError(f"hidden {hidden} is not divisible by TP {tp}.")
                    splits = sorted(
                        ((p, k) for p in spec["chunks"] for k in spec["column_chunks"]),
                        key=lambda pk: (pk != (1, 1), pk),
                    )
                    for p, k in splits:
                        if micro_batch % p:
                            raise ValueError(
                                f"micro-batch {micro_batch} is not divisible by p={p}."
                            )
                        if hidden % k:
                            raise ValueError(f"hidden {hidden} is not divisible by k={k}.")
                        configs.append(GemmConfig(shape, p, k))
    return configs


class _Timer:
    """Marks between GEMM groups: CUDA events on the stream, or the wall clock."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start, end) -> float:
        if self.cuda:
            return start.elapsed_time(end) / 1e3
        return end - start

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


@dataclass
class _Operands:
    """Inputs, weights, output gradients and gradient buffers of one shape's four GEMMs."""

    x: dict[str, torch.Tensor]
    w: dict[str, torch.Tensor]
    dy: dict[str, torch.Tensor]
    dx: dict[str, torch.Tensor]
    dw: dict[str, torch.Tensor]


def _operands(shape: GemmShape, device: str, dtype: torch.dtype) -> _Operands:
    t = shape.tokens

    def rand(*size):
        return torch.randn(*size, device=device, dtype=dtype) * 0.02

    ops = _Operands({}, {}, {}, {}, {})
    for name, (n_in, n_out, _) in shape.linears().items():
        ops.x[name] = rand(t, n_in)
        ops.w[name] = rand(n_out, n_in)
        ops.dy[name] = rand(t, n_out)
        ops.dx[name] = torch.empty(t, n_in, device=device, dtype=dtype)
        ops.dw[name] = torch.zeros(n_out, n_in, device=device, dtype=dtype)
    return ops


def _pieces(config: GemmConfig, n_out: int, split: bool) -> Iterator[slice]:
    """Output columns of each piece: ``k`` pieces for a row-parallel GEMM, else one."""
    k = config.column_chunks if split else 1
    width = n_out // k
    for i in range(k):
        yield slice(i * width, (i + 1) * width)


def _forward(config: GemmConfig, ops: _Operands, name: str) -> None:
    n_in, n_out, split = config.shape.linears()[name]
    rows = config.shape.tokens // config.chunks
    for c in range(config.chunks):
        x = ops.x[name][c * rows : (c + 1) * rows]
        pieces = [F.linear(x, ops.w[name][cols]) for cols in _pieces(config, n_out, split)]
        if len(pieces) > 1:
            torch.cat(pieces, dim=-1)


def _backward(config: GemmConfig, ops: _Operands, name: str) -> None:
    n_in, n_out, split = config.shape.linears()[name]
    rows = config.shape.tokens // config.chunks
    for c in range(config.chunks):
        chunk = slice(c * rows, (c + 1) * rows)
        x, dx = ops.x[name][chunk], ops.dx[name][chunk]
        for i, cols in enumerate(_pieces(config, n_out, split)):
            dy, w = ops.dy[name][chunk, cols], ops.w[name][cols]
            if i == 0:
                torch.mm(dy, w, out=dx)
            else:
                dx.addmm_(dy, w)
            ops.dw[name][cols].addmm_(dy.t(), x)


def _backward_autograd(config: GemmConfig, ops: _Operands, name: str) -> None:
    """The backward as autograd runs it without gradient-accumulation fusion (docstring)."""
    n_in, n_out, split = config.shape.linears()[name]
    rows = config.shape.tokens // config.chunks
    weight_grad = None
    for c in range(config.chunks):
        chunk = slice(c * rows, (c + 1) * rows)
        x, dx = ops.x[name][chunk], ops.dx[name][chunk]
        pieces = list(_pieces(config, n_out, split))
        for i, cols in enumerate(pieces):
            dy, w = ops.dy[name][chunk, cols], ops.w[name][cols]
            if i == 0:
                torch.mm(dy, w, out=dx)
            else:
                dx.addmm_(dy, w)
            grad = torch.mm(dy.t(), x)
            if len(pieces) > 1:  # the slice's backward: a zero-padded whole-weight gradient
                padded = grad.new_zeros(n_out, n_in)
                padded[cols] = grad
                grad = padded
            weight_grad = grad if weight_grad is None else weight_grad.add_(grad)


def _chunk_copy(config: GemmConfig, ops: _Operands) -> None:
    """The batch split's chunks of the block input ``[s, b, h]`` made contiguous."""
    shape = config.shape
    full = ops.x["qkv"].view(shape.seq, shape.micro_batch, shape.hidden)
    width = shape.micro_batch // config.chunks
    for c in range(config.chunks):
        full[:, c * width : (c + 1) * width].contiguous()


_PHASES = {"fwd": _forward, "bwd": _backward, "bwd_autograd": _backward_autograd}


def _time_one(
    config: GemmConfig, ops: _Operands, timer: _Timer, warmup: int, iters: int
) -> dict[str, dict[str, float]]:
    """Median seconds per GEMM and phase (:data:`_PHASES`) over ``iters`` iterations after
    ``warmup``, and of the chunk copy (under ``"copy"``)."""
    samples: dict[str, dict[str, list[float]]] = {p: {g: [] for g in GEMMS} for p in _PHASES}
    samples["copy"] = {"chunks": []}
    for iteration in range(warmup + iters):
        marks = []
        for phase, step in _PHASES.items():
            for name in GEMMS:
                start = timer.mark()
                step(config, ops, name)
                marks.append((phase, name, start, timer.mark()))
        start = timer.mark()
        _chunk_copy(config, ops)
        marks.append(("copy", "chunks", start, timer.mark()))
        timer.sync()
        if iteration >= warmup:
            for phase, name, start, end in marks:
                samples[phase][name].append(timer.seconds(start, end))
    return {
        phase: {name: statistics.median(v) for name, v in by_gemm.items()}
        for phase, by_gemm in samples.items()
    }


def _flops(shape: GemmShape, name: str) -> float:
    n_in, n_out, _ = shape.linears()[name]
    return 2.0 * shape.tokens * n_in * n_out


def time_configurations(
    configs: list[GemmConfig],
    *,
    device: str,
    dtype: torch.dtype,
    warmup: int,
    iters: int,
    deadline: float,
    progress: Callable[[str], None] = print,
) -> tuple[list[dict], int]:
    """Time ``configs`` until done or ``deadline`` (``time.monotonic()``); rows and how many
    configurations were left untimed.

    Each row: the shape, p, k, seconds and TFLOP/s per GEMM and pass, the layer's totals,
    and ``fwd_ratio`` / ``bwd_ratio``: TFLOP/s relative to ``p = k = 1`` of the same shape
    (``None`` when that configuration is not in ``configs``).
    """
    timer = _Timer(device)
    rows: list[dict] = []
    baselines: dict[GemmShape, dict] = {}
    operands: tuple[GemmShape, _Operands] | None = None
    for index, config in enumerate(configs):
        if time.monotonic() > deadline:
            return rows, len(configs) - index
        if operands is None or operands[0] != config.shape:
            operands = None
            if device == "cuda":
                torch.cuda.empty_cache()
            operands = (config.shape, _operands(config.shape, device, dtype))
        seconds = _time_one(config, operands[1], timer, warmup, iters)
        row = dict(asdict(config.shape), p=config.chunks, k=config.column_chunks)
        for phase, factor in (("fwd", 1.0), ("bwd", 2.0), ("bwd_autograd", 2.0)):
            total_s = sum(seconds[phase].values())
            total_flops = sum(factor * _flops(config.shape, g) for g in GEMMS)
            for name in GEMMS:
                row[f"{phase}_{name}_tflops"] = (
                    factor * _flops(config.shape, name) / seconds[phase][name] / 1e12
                )
            row[f"{phase}_ms"] = total_s * 1e3
            row[f"{phase}_tflops"] = total_flops / total_s / 1e12
        row["chunk_copy_ms"] = seconds["copy"]["chunks"] * 1e3 if config.chunks > 1 else 0.0
        if (config.chunks, config.column_chunks) == (1, 1):
            baselines[config.shape] = row
        base = baselines.get(config.shape)
        for phase in ("fwd", "bwd", "bwd_autograd"):
            row[f"{phase}_ratio"] = (
                row[f"{phase}_tflops"] / base[f"{phase}_tflops"] if base else None
            )
        rows.append(row)
        progress(
            f"gemm h={row['hidden']} b={row['micro_batch']} s={row['seq']} p={row['p']} "
            f"k={row['k']}: fwd {row['fwd_tflops']:.3g} TFLOP/s ({_ratio(row['fwd_ratio'])}), "
            f"bwd {row['bwd_tflops']:.3g} TFLOP/s ({_ratio(row['bwd_ratio'])}) "
            f"[{index + 1}/{len(configs)}]"
        )
    return rows, 0


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def gemm_table(rows: list[dict]) -> str:
    """The Markdown table of :func:`time_configurations`' rows (TFLOP/s per rank)."""
    header = (
        "| h | b | s | TP | p | k | rows/GEMM | QKV | proj | fc1 | fc2 | fwd layer | fwd vs p1k1 "
        "| bwd layer | bwd vs p1k1 | bwd autograd | vs p1k1 | chunk copy ms |"
    )
    lines = [header, "|" + "---|" * 18]
    for r in rows:
        gemm_cells = " | ".join(f"{r[f'fwd_{g}_tflops']:.3g}" for g in GEMMS)
        lines.append(
            f"| {r['hidden']} | {r['micro_batch']} | {r['seq']} | {r['tp']} | {r['p']} | "
            f"{r['k']} | {r['micro_batch'] * r['seq'] // r['p']} | {gemm_cells} | "
            f"{r['fwd_tflops']:.3g} | {_ratio(r['fwd_ratio'])} | {r['bwd_tflops']:.3g} | "
            f"{_ratio(r['bwd_ratio'])} | {r['bwd_autograd_tflops']:.3g} | "
            f"{_ratio(r['bwd_autograd_ratio'])} | {r['chunk_copy_ms']:.3g} |"
        )
    return "\n".join(lines)
