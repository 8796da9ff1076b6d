"""A scoped, reversible runtime that lets Megatron-Core's local-spec GPT train on the CPU.

Megatron-Core assumes a CUDA device in a handful of places that sit on the path of every
tensor-parallel training step, even when the model itself is built on the CPU with
``use_cpu_initialization=True``. Tests, the demo and CPU runs of the training script need
that path with ``torch.distributed`` gloo and TP > 1, so :func:`cpu_runtime` maps each of
those places to the CPU for the duration of a ``with`` block:

* **The device generator is the CPU generator.** ``model_parallel_cuda_manual_seed`` and the
  RNG tracker's ``fork()`` (attention dropout, activation recompute) save, seed and restore
  the CUDA generator. On the CPU, dropout draws from the CPU default generator, so that is the
  one they must swap. Megatron's semantics carry over unchanged: inside
  ``get_cuda_rng_tracker().fork()`` the generator holds the TP-rank-specific stream
  (``seed + 2718 + tp_rank``); outside it holds the default stream (``seed``), identical on
  every TP rank.
* **CUDA device arguments mean the CPU.** Megatron allocates on
  ``torch.cuda.current_device()`` (global memory buffer, RoPE frequencies, sequence-parallel
  buffers), and the optimizer wrappers and ``clip_grads`` pass a literal ``device='cuda'``.
  ``torch.cuda.current_device()`` returns device index 0, and a
  :class:`torch.overrides.TorchFunctionMode` rewrites every CUDA ``device=`` argument
  (``'cuda'``, ``'cuda:N'``, ``torch.device('cuda')`` or an index) and ``Tensor.cuda()`` to
  the CPU, which covers all of them in one place.
* **Synchronisation is a no-op.** ``torch.cuda.synchronize()`` is called by
  ``dist_checkpointing``'s async writer and finalize step, and by DDP; DDP's gradient sync
  (megatron-core 0.19) also asks for ``torch.cuda.current_stream()`` to wait on CUDA-graph
  events, which a stream stand-in with no-op waits answers.
* **Type checks accept CPU tensors.** ``clip_grad_by_total_norm_fp32`` asserts
  ``param.grad.type() == 'torch.cuda.FloatTensor'``, and the bf16 and distributed optimizers
  sort parameters by ``param.type()`` into ``torch.cuda.*Tensor`` names; while those three
  run (and only then), ``Tensor.type()`` names CPU tensors by their CUDA type.

Each patch keeps the original object and restores it on exit, in reverse order, even when the
block raises. The attribute patches are process-wide; the device mode, like every PyTorch
function mode, applies to the thread that entered the runtime (CPU autograd runs there too). Entering while a runtime is active raises: the patches are process-global and
applying them twice would make the second exit restore patched objects. Nothing of this is
ever active next to a real GPU: entering with CUDA available raises, and
:func:`runtime_for_device` returns a null context there.

One mechanism, kept in one module although it passes 300 lines: the patch table
(:data:`PATCHES`, each entry with its reason) is a third of it, and splitting it from the
runtime that applies it would hide why each patch exists.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator

import torch
from megatron.core.optimizer import clip_grads as megatron_clip_grads
from megatron.core.optimizer import optimizer as megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
from megatron.core.tensor_parallel import random as megatron_random
from torch.overrides import TorchFunctionMode

from megatron_domino.runtime.patch import Patch

__all__ = [
    "CpuRuntime",
    "CpuRuntimeError",
    "PATCHES",
    "cpu_runtime",
    "cpu_runtime_active",
    "runtime_for_device",
]


class CpuRuntimeError(RuntimeError):
    """The CPU runtime was entered where it must not be (twice, or next to a GPU)."""


def _is_cuda_device(device: object) -> bool:
    """Whether ``device`` (a ``device=`` argument) names a CUDA device.

    A bare integer is a CUDA index in PyTorch's device arguments, and it is what
    ``torch.cuda.current_device()`` returns.
    """
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return torch.device(device).type == "cuda"
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaDevicesToCpu(TorchFunctionMode):
    """Runs every torch function asked to place a tensor on a CUDA device on the CPU instead.

    Handles the ``device=`` keyword of any torch function (factories, ``Tensor.to``,
    ``Tensor.new_*``), the positional device of ``Tensor.to``, and ``Tensor.cuda()``, which on
    the CPU stand-in device is the identity, as it is for a tensor already on its GPU.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda_device(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _CudaTypeNames(TorchFunctionMode):
    """Makes ``Tensor.type()`` name a CPU tensor by its CUDA type (``torch.cuda.FloatTensor``).

    Only ``type()`` without arguments is answered; conversions (``type(dtype)``) pass through.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return "torch.cuda." + func(args[0]).removeprefix("torch.")
        return func(*args, **kwargs)


def _with_cuda_type_names(original: Callable) -> Callable:
    """Wrap a Megatron function that checks ``Tensor.type()`` against CUDA type names.

    While the wrapper runs, :class:`_CudaTypeNames` makes a CPU tensor report its CUDA type
    (a CPU fp32 gradient is then ``torch.cuda.FloatTensor``), so the check passes for exactly
    the dtypes it accepts on a GPU and still fails for the others. Outside these calls
    ``Tensor.type()`` is left alone.
    """

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        with _CudaTypeNames():
            return original(*args, **kwargs)

    return wrapper


_clip_grad_by_total_norm_fp32_on_cpu = _with_cuda_type_names(
    megatron_clip_grads.clip_grad_by_total_norm_fp32
)


def _seed_cpu_generator(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _get_cpu_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, *args, **kwargs) -> None:
    torch.set_rng_state(new_state)


def _current_device() -> int:
    return 0


def _synchronize(device: object = None) -> None:
    return None


class _InOrderStream:
    """A CUDA stream stand-in: the CPU runs everything in order, so every wait is a no-op."""

    def wait_stream(self, stream: object) -> None:
        return None

    def wait_event(self, event: object) -> None:
        return None

    def synchronize(self) -> None:
        return None


def _current_stream(device: object = None) -> _InOrderStream:
    return _InOrderStream()


_engine_run_backward = torch.autograd.graph._engine_run_backward


def _engine_run_backward_with_cpu_devices(*args, **kwargs):
    """Run the autograd engine under the device mode.

    The device mode intercepts ``Tensor.backward`` itself, and a mode's handler runs with the
    mode popped, so without this every ``backward`` (Megatron-Core's sequence-parallel linear
    allocates with ``device=torch.cuda.current_device()`` there) would escape the mode.
    """
    with _CudaDevicesToCpu():
        return _engine_run_backward(*args, **kwargs)


#: Everything :func:`cpu_runtime` replaces, in the order it is applied.
PATCHES: tuple[Patch, ...] = (
    Patch(
        torch.cuda,
        "current_device",
        _current_device,
        "Megatron allocates on it (memory buffer, RoPE, SP); index 0 is then mapped to the CPU.",
    ),
    Patch(
        torch.autograd,
        "_engine_run_backward",
        _engine_run_backward_with_cpu_devices,
        "backward() and grad() run the engine through it; backward code must see the mode.",
    ),
    Patch(
        torch.cuda,
        "synchronize",
        _synchronize,
        "dist_checkpointing's async writer and finalize, and DDP, synchronise the device.",
    ),
    Patch(
        torch.cuda,
        "current_stream",
        _current_stream,
        "DDP's start_grad_sync (0.19 param_and_grad_buffer.py:632) waits on the current stream.",
    ),
    Patch(
        torch.cuda,
        "manual_seed",
        _seed_cpu_generator,
        "model_parallel_cuda_manual_seed and the tracker's add() seed the device generator.",
    ),
    Patch(
        torch.cuda,
        "get_rng_state",
        _get_cpu_rng_state,
        "The tracker's add() and the rerun state machine snapshot the device generator.",
    ),
    Patch(
        torch.cuda,
        "set_rng_state",
        _set_cpu_rng_state,
        "The rerun state machine restores the device generator.",
    ),
    Patch(
        megatron_random,
        "_get_cuda_rng_state",
        _get_cpu_rng_state,
        "fork() and activation recompute save the device generator through it.",
    ),
    Patch(
        megatron_random,
        "_set_cuda_rng_state",
        _set_cpu_rng_state,
        "fork() and activation recompute restore the device generator through it.",
    ),
    Patch(
        megatron_clip_grads,
        "clip_grad_by_total_norm_fp32",
        _clip_grad_by_total_norm_fp32_on_cpu,
        "It asserts grads are torch.cuda.FloatTensor (for direct callers of clip_grads).",
    ),
    Patch(
        megatron_optimizer,
        "clip_grad_by_total_norm_fp32",
        _clip_grad_by_total_norm_fp32_on_cpu,
        "MegatronOptimizer.clip_grad_norm calls the name bound here at import.",
    ),
    Patch(
        Float16OptimizerWithFloat16Params,
        "__init__",
        _with_cuda_type_names(Float16OptimizerWithFloat16Params.__init__),
        "The bf16 optimizer sorts params by type() into torch.cuda.{BFloat16,Float}Tensor.",
    ),
    Patch(
        DistributedOptimizer,
        "__init__",
        _with_cuda_type_names(DistributedOptimizer.__init__),
        "The distributed optimizer sorts params by type() into torch.cuda.* tensor types.",
    ),
)

#: fork() compares the CPU generator before and after its body to catch stray CPU draws; on
#: the CPU that generator *is* the forked one, so every dropout inside fork() would log this.
_FORK_WARNING = "CPU RNG state changed within GPU RNG context"


class _DropForkWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != _FORK_WARNING


@contextlib.contextmanager
def _fork_warning_silenced() -> Iterator[None]:
    logger = logging.getLogger(megatron_random.__name__)
    log_filter = _DropForkWarning()
    logger.addFilter(log_filter)
    try:
        yield
    finally:
        logger.removeFilter(log_filter)


_active = False


def cpu_runtime_active() -> bool:
    """Whether a :class:`CpuRuntime` is active in this process."""
    return _active


class CpuRuntime(contextlib.AbstractContextManager):
    """Context manager applying :data:`PATCHES`, the CUDA-to-CPU device mode and the fork
    warning filter; see the module docstring for why each is needed.

    Raises:
        CpuRuntimeError: on entry when CUDA is available (use :func:`runtime_for_device`), or
            when a runtime is already active in this process.
    """

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> CpuRuntime:
        global _active
        if torch.cuda.is_available():
            raise CpuRuntimeError(
                "The CPU runtime maps CUDA devices to the CPU and must not run next to a GPU; "
                "use runtime_for_device(), which is a no-op when CUDA is available."
            )
        if _active:
            raise CpuRuntimeError(
                "The CPU runtime is already active in this process; enter it once, around the "
                "whole run."
            )
        with contextlib.ExitStack() as stack:
            for patch in PATCHES:
                stack.enter_context(patch.applied())
            stack.enter_context(_fork_warning_silenced())
            stack.enter_context(_CudaDevicesToCpu())
            self._stack = stack.pop_all()
        _active = True
        return self

    def __exit__(self, *exc_info) -> None:
        global _active
        stack, self._stack = self._stack, None
        try:
            stack.close()
        finally:
            _active = False


def cpu_runtime() -> CpuRuntime:
    """The CPU runtime, to be used as ``with cpu_runtime(): ...`` around a whole CPU run."""
    return CpuRuntime()


def runtime_for_device() -> contextlib.AbstractContextManager:
    """The runtime the current machine needs: a null context with CUDA, else :func:`cpu_runtime`."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    return cpu_runtime()
