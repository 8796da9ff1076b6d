"""TEST-ONLY shim: run a gloo collective on device tensors by staging them through host memory.

Where the probe (:mod:`lab.gpu_check.probe`) finds that this torch's gloo cannot
run a collective on CUDA tensors, the GPU check can still compare Domino with stock
Megatron-Core on the GPU: inside :func:`host_staged`, each named collective copies its device
input to a host tensor, runs gloo there (blocking, or ``async_op=True`` with a work object), and
copies the result back into the device output when the caller waits. Both arms of a comparison
(stock and Domino) then go through the same shim, so the numbers stay comparable.

It is never for training: the copies are synchronous, so timings measured under it say
nothing about overlap on a real interconnect, and the report says so whenever it was used.

What is replaced, for each staged collective (the original objects come back on exit):
``torch.distributed.<name>``, which Domino and Megatron-Core look up at call time, and the
aliases Megatron-Core binds at import (``dist_all_gather_func``, ``dist_reduce_scatter_func``
in ``tensor_parallel.mappings``, ``tensor_parallel.layers``, ``tensor_parallel.utils`` and
``megatron.core.utils``). The copy back writes through ``.data``: a collective writes its
output behind autograd's back, so the output's version counter must not change.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from megatron_domino.runtime.patch import Patch

__all__ = ["STAGEABLE", "host_staged"]

#: Megatron-Core modules that bind the tensor collectives to a module-level name at import.
_MEGATRON_ALIASES = {
    "all_gather_into_tensor": ("dist_all_gather_func",),
    "reduce_scatter_tensor": ("dist_reduce_scatter_func",),
}
_MEGATRON_MODULES = (
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.utils",
)


class _StagedWork:
    """The work object of a staged async collective: ``wait`` also copies the result back."""

    def __init__(self, work, copy_back: Callable[[], None]) -> None:
        self._work = work
        self._copy_back = copy_back
        self._done = False

    def wait(self, timeout=None) -> bool:
        if not self._done:
            self._work.wait()
            self._copy_back()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def _finish(work, async_op: bool, copy_back: Callable[[], None]):
    if async_op:
        return _StagedWork(work, copy_back)
    copy_back()
    return None


def _staged_all_reduce(original: Callable) -> Callable:
    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        host = _to_host(tensor)
        work = original(host, op=op, group=group, async_op=async_op)
        return _finish(work, async_op, lambda: tensor.data.copy_(host))

    return all_reduce


def _staged_all_gather_into_tensor(original: Callable) -> Callable:
    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        host_out = torch.empty(output_tensor.shape, dtype=output_tensor.dtype, device="cpu")
        work = original(host_out, _to_host(input_tensor), group=group, async_op=async_op)
        return _finish(work, async_op, lambda: output_tensor.data.copy_(host_out))

    return all_gather_into_tensor


def _staged_reduce_scatter_tensor(original: Callable) -> Callable:
    def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        host_out = torch.empty(output.shape, dtype=output.dtype, device="cpu")
        work = original(host_out, _to_host(input), op=op, group=group, async_op=async_op)
        return _finish(work, async_op, lambda: output.data.copy_(host_out))

    return reduce_scatter_tensor


_WRAPPERS = {
    "all_reduce": _staged_all_reduce,
    "all_gather_into_tensor": _staged_all_gather_into_tensor,
    "reduce_scatter_tensor": _staged_reduce_scatter_tensor,
}
#: The collectives the shim can stage: all that the probe tries.
STAGEABLE = tuple(_WRAPPERS)


def _patches(collectives: Iterable[str]) -> list[Patch]:
    patches = []
    for name in collectives:
        if name not in _WRAPPERS:
            raise ValueError(f"cannot stage {name!r}; stageable: {', '.join(STAGEABLE)}.")
        staged = _WRAPPERS[name](getattr(dist, name))
        why = f"TEST-ONLY: gloo lacks {name} on device tensors; staged through host memory."
        patches.append(Patch(dist, name, staged, why))
        for alias in _MEGATRON_ALIASES.get(name, ()):
            for module_name in _MEGATRON_MODULES:
                module = importlib.import_module(module_name)
                if alias in vars(module):
                    patches.append(Patch(module, alias, staged, why))
    return patches


@contextlib.contextmanager
def host_staged(collectives: Iterable[str], *, verify_on: str | None = None) -> Iterator[list[str]]:
    """Stage the named collectives through host memory while the block runs.

    Args:
        collectives: names from :data:`STAGEABLE`; empty replaces nothing.
        verify_on: a device (``cuda``/``cpu``): first run the probe's checks through the shim
            on that device's tensors, on every rank, and raise if a staged collective gives a
            wrong result. Needs the process group; every rank must enter together.
    Yields:
        The names staged. Everything is restored on exit, also when the block raises.
    Raises:
        RuntimeError: ``verify_on`` was given and the shim failed its own check.
    """
    names = list(dict.fromkeys(collectives))
    with contextlib.ExitStack() as stack:
        for patch in _patches(names):
            stack.enter_context(patch.applied())
        if names and verify_on is not None:
            from lab.gpu_check.probe import probe_collectives

            failed = [o for o in probe_collectives(verify_on) if o.collective in names and not o.ok]
            if failed:
                raise RuntimeError(
                    "the host-staging shim failed its own check: "
                    + "; ".join(f"{o.collective} {o.dtype}: {o.error}" for o in failed)
                )
        yield names
