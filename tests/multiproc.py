"""Run a test function on N gloo ranks (one process each) and collect the results.

A thin front for :func:`lab.launch.ranks.run_ranks`, the spawner the GPU check uses too:
every rank enters the CPU runtime, initialises Megatron-Core's parallel state (TP = all ranks
unless told otherwise), runs ``fn(*args)`` and tears the state down. ``fn`` must be a
module-level function of an importable module (a test module is fine); its return value
travels back pickled. A rank that raises, dies or hangs past ``timeout_s`` fails the test with
that rank's traceback, and every rank is killed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from lab.launch.ranks import CPU_PRELOAD, run_ranks

#: The fork server of the Transformer Engine tests' ranks: TE booted on the CPU
#: (:mod:`te_cpu`) before Megatron-Core is imported, so Megatron's ``HAVE_TE`` is true there and
#: only there (the other tests run Megatron-Core as a user without TE does).
TE_PRELOAD = ("torch", "te_cpu.booted", *CPU_PRELOAD)

#: Long enough for 8 ranks to import Megatron-Core and run a tiny model on 2 cores.
DEFAULT_TIMEOUT_S = 180.0


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    tensor_model_parallel_size: int | None = None,
    pipeline_model_parallel_size: int = 1,
    seed: int = 1234,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    te: bool = False,
) -> list[Any]:
    """``[fn(*args) on rank 0, on rank 1, ...]`` on ``world_size`` CPU gloo ranks; with ``te``,
    ranks with Transformer Engine's own Python booted (:data:`TE_PRELOAD`)."""
    return run_ranks(
        f"{fn.__module__}:{fn.__qualname__}",
        world_size,
        device="cpu",
        args=args,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        seed=seed,
        timeout_s=timeout_s,
        preload=TE_PRELOAD if te else CPU_PRELOAD,
    )
