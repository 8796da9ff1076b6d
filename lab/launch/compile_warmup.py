"""torch.compile's once-per-process set-up, done in the CPU ranks' fork server.

Megatron-Core compiles its fused kernels (``jit_fuser`` is ``torch.compile``: bias + GeLU,
bias + SwiGLU, bias + dropout + add, ...) in every rank: ``initialize_megatron`` warms them
up, and a model built outside Megatron-LM's loop compiles them on its first step. Before its
first graph each process sets up TorchDynamo and Inductor (their lazy imports, the CPU's
vector-instruction probe, the pattern-matcher passes): about 2 s per rank on two cores, more
than a tiny model's graphs then cost with Inductor's on-disk cache warm. Importing this module
(:data:`lab.launch.ranks.CPU_PRELOAD`) does that set-up once in the server, by
compiling and running one elementwise function; every rank forked from the server starts
with it done and still compiles, traces and guards Megatron's kernels itself.

Inductor compiles in the calling process here (``compile_threads = 1``): a pool of compile
workers started in the server would be shared by every rank forked from it.
"""

from __future__ import annotations

import torch
import torch._inductor.config as inductor_config

inductor_config.compile_threads = 1


@torch.compile
def _affine(x: torch.Tensor) -> torch.Tensor:
    """A one-kernel graph: ``x * 2 + 1`` (any shape)."""
    return x * 2 + 1


_affine(torch.ones(4))
