"""What Megatron-LM's own training loop (``megatron.training.pretrain``) needs to run from the
``megatron-core`` wheel, and to run on a machine without CUDA.

Two sets of :class:`~megatron_domino.runtime.patch.Patch` es, each undone on exit:

* :data:`WHEEL_PATCHES`, on every machine: ``initialize_megatron`` compiles the dataset index
  helpers with ``make`` in ``megatron/core/datasets``, but the wheel ships them prebuilt
  (``helpers_cpp``) and without the Makefile, so rank 0 would exit. The replacement only
  checks that the prebuilt module imports, and says what to do when it does not.
* :data:`CPU_LOOP_PATCHES`, without CUDA, on top of
  :func:`~megatron_domino.runtime.cpu_runtime.cpu_runtime` (device arguments, RNG, synchronisation):
  the places where the loop itself insists on a GPU. Two of them would fail *silently* if
  they stopped applying (without a device count, Megatron skips creating the model-parallel
  groups and seeding the TP RNG tracker), which is why every patched attribute is checked
  to exist when the runtime is entered (:meth:`Patch.applied` raises otherwise) and the
  training script asserts the TP layout it got.

And on every machine, the checkpoint writer's result queue, created up front by
:func:`start_write_results_queue`: ``dist_checkpointing`` passes each save's results through a
``multiprocessing`` manager process it spawns on the first save. SLURM signals every process of
a job step before its time limit, so with ``--exit-signal-handler`` that manager died of the
SIGTERM that asks the rank to save, and the save the signal asked for failed with
``ConnectionRefusedError``. Here it ignores SIGTERM and SIGINT (the rank that owns it decides
when to stop) and dies with its rank (``PR_SET_PDEATHSIG``), so it never outlives a killed one
(:mod:`.signal_shield`).

And one exit hook, for ranks that fail: with ``--exit-signal-handler`` Megatron installs its
SIGTERM handler before the DataLoader workers are forked, so they inherit it and SIGTERM only
sets a flag in them (which keeps them alive through SLURM's signal, as the save needs). But a
rank that dies of an exception keeps its data iterators referenced from the traceback, and
``multiprocessing``'s exit function then sends SIGTERM to its daemonic children and joins them:
forever. torchrun SIGKILLs it 30 s later; without torchrun it hangs. :func:`megatron_loop_runtime`
registers :func:`_kill_daemonic_children` to run first at exit, with SIGKILL.

And one on the CPU only so that a ``--use-distributed-optimizer`` run resumes: on the CPU
Megatron-Core 0.19's distributed optimizer runs torch's Adam (without Apex or Transformer
Engine; with TE's Python booted for tests, its GPU-only FusedAdam is replaced by torch's), whose
state (``exp_avg``, ``exp_avg_sq``, ``step``) does not exist before its first step, and loading
a checkpoint first calls ``DistributedOptimizer.state_dict``, which asserts that the state's
steps agree without Apex or TE (``distrib_optimizer.py:838-840``, no steps at all), and with TE
looks for the step count in the parameter groups, where torch's Adam keeps none (``:846-856``):
the count would not be saved, so the patched ``state_dict`` puts it there. :data:`CPU_LOOP_PATCHES` makes
that state before ``state_dict`` reads it (:func:`start_torch_adam_state`): the zeros and step 0
torch's Adam would make at its first step, so a run that loads nothing trains as before, and a
resumed one has the loaded values in them. The load then copies the saved parameter state into
the optimizer's fp32 main parameters, which for fp32 weights are views of the model's own
(``requires_grad``) parameters (``distrib_optimizer.py:466-469``), in place and outside
``torch.no_grad`` for the ``dp_reshardable`` format Megatron-LM saves (``:2061``, where the
other formats' loaders are decorated with it, ``:2095``): autograd refuses that, so the patch
runs ``load_state_dict`` under ``torch.no_grad`` (a load computes nothing to differentiate).
Last, that load puts the saved step count (kept in the parameter groups) into one ``step``
tensor shared by every parameter's state (``distrib_optimizer.py:1027-1031``), and then copies
the parameter state over it, a ``step`` entry included, which the saved bucket buffers do not
hold as the step count (a resumed run's Adam started again from step 0: its second step
differed from the uninterrupted run's). After the load the patch gives each parameter's state
its own ``step``, the count the parameter groups were saved with.

And one on the CPU only, for correctness rather than to avoid a crash: the DataLoader draws
its base seed from the CPU generator, which on the CPU is also the "CUDA" generator dropout
draws from, so creating the data iterators would shift dropout's stream by a resume-dependent
amount. :data:`CPU_LOOP_PATCHES` builds them under ``torch.random.fork_rng``, so a resumed run
draws the same dropout masks as an uninterrupted one.

File:line references are to the megatron-core 0.19.2 wheel.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import multiprocessing
import os
import signal
from collections.abc import Iterator
from multiprocessing.managers import SyncManager

import torch
from megatron.core.datasets import utils as datasets_utils
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.optimizer import distrib_optimizer
from megatron.training import arguments as megatron_arguments
from megatron.training import training as megatron_training

from megatron_domino.runtime.cpu_runtime import cpu_runtime
from megatron_domino.runtime.patch import Patch
from megatron_domino.training.signal_shield import shield_from_job_signals

__all__ = [
    "CPU_LOOP_PATCHES",
    "start_torch_adam_state",
    "WHEEL_PATCHES",
    "megatron_loop_runtime",
    "start_write_results_queue",
]

#: Megatron-LM asks the GPU's compute capability major (8 Ampere, 9 Hopper, 10 Blackwell) to
#: choose defaults; on the CPU it is answered as a Hopper (H100/H200) would, our users' GPU.
HOPPER_ARCH = 9


class _NoStream:
    """A CUDA stream stand-in: waits are no-ops (the CPU runs everything in order)."""

    def wait_stream(self, stream: object) -> None:
        return None

    def synchronize(self) -> None:
        return None


def _check_prebuilt_helpers() -> None:
    """Replace ``compile_helpers``: the wheel's prebuilt ``helpers_cpp`` must import."""
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError as err:
        raise RuntimeError(
            "megatron.core.datasets.helpers_cpp (the dataset index helpers, prebuilt in the "
            "megatron-core wheel) does not import. Reinstall the wheel "
            "(`pip install --force-reinstall megatron-core`), or with a Megatron-LM checkout "
            "run `make -C megatron/core/datasets` in it."
        ) from err


def _initialize_megatron_without_cuda(**kwargs):
    return _initialize_megatron(allow_no_cuda=True, **kwargs)


_initialize_megatron = megatron_training.initialize_megatron


def _one_device() -> int:
    return 1


def _no_nvml_answer() -> bool:
    return False


def _set_device(device: object) -> None:
    return None


def _null_stream_context(stream: object = None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _no_stream(*args, **kwargs) -> _NoStream:
    return _NoStream()


def _hopper_arch() -> int:
    return HOPPER_ARCH


def _with_cpu_generator_forked(build):
    @functools.wraps(build)
    def wrapper(*args, **kwargs):
        with torch.random.fork_rng(devices=[]):
            return build(*args, **kwargs)

    return wrapper


def start_torch_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a torch ``Adam``/``AdamW`` that has not stepped the state its first step would make
    (``step`` 0, ``exp_avg`` and ``exp_avg_sq`` zeros, ``max_exp_avg_sq`` with ``amsgrad``), in
    the dtype and layout torch's Adam makes them; a no-op for any other optimizer and for
    parameters that have state."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            if state:
                continue
            step_dtype = (
                torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
            )
            state["step"] = torch.tensor(0.0, dtype=step_dtype)
            names = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
            for name in names:
                state[name] = torch.zeros_like(param, memory_format=torch.preserve_format)


_distributed_optimizer_state_dict = distrib_optimizer.DistributedOptimizer.state_dict


def _torch_adam(optimizer) -> bool:
    return isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)


def _state_dict_with_adam_state(self) -> dict:
    """``DistributedOptimizer.state_dict`` once its torch Adam has state, the step count in
    its parameter groups (module docstring)."""
    if not _torch_adam(self.optimizer):
        return _distributed_optimizer_state_dict(self)
    start_torch_adam_state(self.optimizer)
    state_dict = _distributed_optimizer_state_dict(self)
    steps = {float(state["step"]) for state in self.optimizer.state.values() if "step" in state}
    if len(steps) == 1:
        (step,) = steps
        for group in state_dict["optimizer"]["param_groups"]:
            group.setdefault("step", step)
    return state_dict


_distributed_optimizer_load_state_dict = distrib_optimizer.DistributedOptimizer.load_state_dict


def _load_state_dict_without_grad(self, state_dict: dict) -> None:
    """``DistributedOptimizer.load_state_dict`` under ``torch.no_grad``, then each parameter's
    ``step`` its own tensor holding the saved count (module docstring)."""
    if _torch_adam(self.optimizer):
        start_torch_adam_state(self.optimizer)
    with torch.no_grad():
        _distributed_optimizer_load_state_dict(self, state_dict)
    if not _torch_adam(self.optimizer):
        return
    steps = {group["step"] for group in state_dict["optimizer"]["param_groups"] if "step" in group}
    if len(steps) != 1:
        raise RuntimeError(
            f"the distributed optimizer's saved step counts disagree: {sorted(steps)}"
        )
    (step,) = steps
    for state in self.optimizer.state.values():
        if "step" in state:
            state["step"] = torch.tensor(float(step), dtype=state["step"].dtype)


#: Needed wherever Megatron-LM's loop runs from the wheel, GPU or not.
WHEEL_PATCHES: tuple[Patch, ...] = (
    Patch(
        datasets_utils,
        "compile_helpers",
        _check_prebuilt_helpers,
        "initialize.py:178 runs `make` in the wheel's datasets folder, which has no Makefile.",
    ),
)

#: Needed on top of the CPU runtime where there is no CUDA.
CPU_LOOP_PATCHES: tuple[Patch, ...] = (
    Patch(
        megatron_arguments,
        "get_device_arch_version",
        _hopper_arch,
        "validate_args (arguments.py:1414) reads cuda:0's compute capability.",
    ),
    Patch(
        megatron_training,
        "initialize_megatron",
        _initialize_megatron_without_cuda,
        "pretrain (training.py:1091) asserts CUDA unless allow_no_cuda is passed.",
    ),
    Patch(
        torch.cuda,
        "device_count",
        _one_device,
        "initialize.py:358/447 create the TP groups and seed the TP RNG only when it is > 0.",
    ),
    Patch(
        torch.cuda,
        "_nvml_based_avail",
        _no_nvml_answer,
        "with PYTORCH_NVML_BASED_CUDA_CHECK=1 (``import deepspeed`` sets it) torch.cuda.is_available "
        "answers device_count() > 0, which the patch above makes true; TorchDynamo then asks "
        "CUDA for its current stream when initialize.py:526 warms the fused kernels.",
    ),
    Patch(torch.cuda, "set_device", _set_device, "initialize.py:282 selects the rank's GPU."),
    Patch(torch.cuda, "Stream", _no_stream, "DDP wrapping (training.py:1876) uses a side stream."),
    Patch(
        torch.cuda,
        "current_stream",
        _no_stream,
        "DDP wrapping waits for the default stream (training.py:1877, 1896).",
    ),
    Patch(torch.cuda, "stream", _null_stream_context, "DDP wrapping runs in a stream context."),
    Patch(
        distrib_optimizer.DistributedOptimizer,
        "state_dict",
        _state_dict_with_adam_state,
        "a resume's load calls it before torch's Adam has state; it asserts on the steps "
        "(distrib_optimizer.py:838-840).",
    ),
    Patch(
        distrib_optimizer.DistributedOptimizer,
        "load_state_dict",
        _load_state_dict_without_grad,
        "it copies into fp32 main params, views of requires_grad parameters, outside no_grad "
        "(distrib_optimizer.py:2061).",
    ),
    Patch(
        megatron_training,
        "build_train_valid_test_data_iterators",
        _with_cpu_generator_forked(megatron_training.build_train_valid_test_data_iterators),
        "the DataLoader's base seed would otherwise come from dropout's generator.",
    ),
)


def start_write_results_queue() -> None:
    """Create ``dist_checkpointing``'s write-results queue (``filesystem_async``, which would
    otherwise create it in the first save) in a manager shielded from job signals."""
    if filesystem_async._results_queue is not None:
        return
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=shield_from_job_signals, initargs=(os.getpid(),))
    filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager alive


def _kill_daemonic_children() -> None:
    """At exit: SIGKILL the daemonic children ``multiprocessing`` would SIGTERM and join
    (without torch's SIGCHLD handler, which would report each as a failed DataLoader worker)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


_EXIT_HOOK_REGISTERED = False


@contextlib.contextmanager
def megatron_loop_runtime() -> Iterator[None]:
    """Everything Megatron-LM's ``pretrain`` needs here, for the body; undone on exit.

    With CUDA: :data:`WHEEL_PATCHES` only. Without: the CPU runtime and
    :data:`CPU_LOOP_PATCHES`. On both, the checkpoint writer's result queue, created up front
    and shielded from job signals (:func:`start_write_results_queue`; its spawn-context manager
    process re-imports ``__main__``, and creating it before the loop starts also keeps that
    out of the first save's time), and the exit hook of the module docstring.
    """
    global _EXIT_HOOK_REGISTERED
    if not _EXIT_HOOK_REGISTERED:  # for the process's exit, after the runtime is undone
        atexit.register(_kill_daemonic_children)
        _EXIT_HOOK_REGISTERED = True
    with contextlib.ExitStack() as stack:
        for patch in WHEEL_PATCHES:
            stack.enter_context(patch.applied())
        if not torch.cuda.is_available():
            stack.enter_context(cpu_runtime())
            for patch in CPU_LOOP_PATCHES:
                stack.enter_context(patch.applied())
        start_write_results_queue()
        yield
