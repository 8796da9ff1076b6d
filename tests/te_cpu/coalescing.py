"""``torch.distributed._coalescing_manager`` for gloo, which has no coalescing: Transformer
Engine's FP8 block all-gather (``--fp8-recipe blockwise`` where the tokens per rank are a
multiple of 128, TE ``pytorch/distributed.py``: ``_start_all_gather_fp8_blockwise``) groups
its data and scale gathers in one NCCL coalesced call, which gloo refuses ("Backend gloo does
not implement startCoalescing"). Here the collectives issued inside the manager run one by
one, each as issued (synchronously), and the manager's ``wait`` has nothing left to wait for:
TE's block gather then runs its own code (layout, scale interleaving, the gathered tensor)
on the CPU, without NCCL's overlap, which only a GPU measures."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

__all__ = ["coalesce_on_gloo"]


class _Done:
    """The manager's handle: the collectives ran when issued."""

    def wait(self) -> None:
        return None


def coalesce_on_gloo() -> None:
    """Replace ``torch.distributed._coalescing_manager`` for gloo groups (module docstring);
    other backends keep torch's."""
    original = dist._coalescing_manager

    @contextlib.contextmanager
    def coalescing_manager(group=None, device=None, async_ops=False) -> Iterator:
        if dist.get_backend(group) != "gloo":
            with original(group=group, device=device, async_ops=async_ops) as manager:
                yield manager
            return
        yield _Done()

    dist._coalescing_manager = coalescing_manager
