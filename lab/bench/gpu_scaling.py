"""An emulated link rate that gives the CPU model a GPU's communication-to-compute ratio.

On a GPU, a layer's TP collective takes ``bytes / busbw`` and its GEMMs ``flops / gemm_rate``.
Scaling the link by the same factor as the compute keeps that ratio on the CPU:

    link rate = GPU busbw x (CPU GEMM FLOP/s / GPU GEMM FLOP/s)

The CPU rate is measured here on the case's own largest GEMM (the MLP's first linear at
TP = 2, one thread, as each benchmark rank runs). The GPU inputs are figures, not measurements
of this project: by default an H100 SXM at 700 TFLOP/s dense bf16 achieved in large GEMMs
(989 peak) and NVLink 4's all-reduce bus bandwidth of 450 GB/s that nccl-tests reports
on 8 x H100 (900 GB/s bidirectional per GPU). The ratio holds per byte and per FLOP; it does
not make a 4-layer model's per-layer shapes those of a real one (docs/benchmarks.md).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

#: Achieved dense bf16 GEMM rate of an H100 SXM (989 TFLOP/s peak).
H100_TFLOPS = 700.0
#: NVLink 4 all-reduce bus bandwidth on 8 x H100 (nccl-tests ``busbw``), GB/s.
H100_NVLINK_BUSBW_GBS = 450.0


@dataclass(frozen=True)
class GpuScaledRate:
    """The emulated link's rate and the inputs it came from."""

    mbit_s: float
    cpu_gflops: float
    gpu_tflops: float
    gpu_busbw_gbs: float

    def describe(self) -> str:
        return (
            f"{self.mbit_s:.0f} Mbit/s = {self.gpu_busbw_gbs:g} GB/s x "
            f"{self.cpu_gflops:.0f} GFLOP/s (this CPU) / {self.gpu_tflops:g} TFLOP/s (GPU)"
        )


def cpu_gemm_gflops(tokens: int, hidden: int, ffn_per_rank: int, repeats: int = 7) -> float:
    """GFLOP/s of one thread on ``[tokens, hidden] @ [hidden, ffn_per_rank]`` (median)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        generator = torch.Generator().manual_seed(0)
        a = torch.randn(tokens, hidden, generator=generator)
        b = torch.randn(hidden, ffn_per_rank, generator=generator)
        a @ b
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            seconds.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return 2 * tokens * hidden * ffn_per_rank / statistics.median(seconds) / 1e9


def gpu_scaled_rate(
    cpu_gflops: float, gpu_tflops: float = H100_TFLOPS, gpu_busbw_gbs: float = H100_NVLINK_BUSBW_GBS
) -> GpuScaledRate:
    """The link rate (module docstring) for a case whose GEMM runs at ``cpu_gflops`` here
    (:func:`cpu_gemm_gflops`)."""
    bytes_s = gpu_busbw_gbs * 1e9 * cpu_gflops / (gpu_tflops * 1e3)
    return GpuScaledRate(bytes_s * 8 / 1e6, cpu_gflops, gpu_tflops, gpu_busbw_gbs)
