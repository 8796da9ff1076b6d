"""What would stop a CUDA graph from capturing and replaying a Domino step, seen from the ops.

A CUDA graph (Megatron-Core's ``--cuda-graph-impl full_iteration``) records the kernels and
collectives one training step launches and replays them later without running any Python:
same kernels, same order, same addresses. A step is capturable only if

1. it never makes the host wait for a device value: ``.item()``, ``float(t)``, ``if t:``
   (a Python branch on a tensor's value), ops whose output shape depends on the data
   (``nonzero``, ``masked_select``, ``unique``, ...), a device-to-host copy, or a tensor made
   from host data inside the step (``torch.tensor(...)``, whose pageable host-to-device copy
   capture forbids and whose value a replay would freeze);
2. its Python issues the same ops, with the same shapes, on every iteration (a replay repeats
   the capture-time sequence whatever the Python would have chosen later);
3. what it reads from outside the step (parameters, gradient buffers, inputs, caches) keeps
   its address from one iteration to the next (a replay reads the capture-time address).

:class:`StepTrace` is a ``TorchDispatchMode`` that sees every ATen and c10d op a forward and
backward dispatch (autograd carries the mode into backward), so it checks all three on any
device: :attr:`StepTrace.hazards` (1), :attr:`StepTrace.ops` to compare between two
iterations (2), :attr:`StepTrace.external_reads` to compare likewise (3). On the CPU a
device-to-host copy cannot occur (one device), so (1) is proven there for everything but
copies; the GPU check (:mod:`lab.gpu_check.check_capture`) runs the same
trace on CUDA tensors and then captures and replays the step.
"""

from __future__ import annotations

import threading
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["HOST_SYNC_OPS", "Hazard", "OpRecord", "StepTrace", "first_difference"]

#: ATen ops (overload packets) that make the host wait for device data, and why.
HOST_SYNC_OPS = {
    "aten::_local_scalar_dense": ".item(), float()/int()/bool() of a tensor, or a Python "
    "branch on a tensor's value (if t: ...) reads a device value on the host",
    "aten::is_nonzero": "bool() of a tensor: a Python branch on a tensor's value",
    "aten::equal": "torch.equal returns a host bool",
    "aten::nonzero": "nonzero's output shape depends on the data (the host reads the count)",
    "aten::masked_select": "masked_select's output shape depends on the data",
    "aten::masked_scatter": "masked_scatter reads the number of selected elements on the host",
    "aten::_unique2": "unique's output shape depends on the data",
    "aten::unique_consecutive": "unique_consecutive's output shape depends on the data",
    "aten::unique_dim": "unique's output shape depends on the data",
    "aten::bincount": "bincount's output length depends on the data",
    "aten::repeat_interleave": "repeat_interleave with tensor repeats reads them on the host",
    "aten::lift_fresh": "a tensor made from host data inside the step (torch.tensor(...)): "
    "a pageable host-to-device copy, and a value a replay would freeze",
}

#: Where a host read is of a tensor that lives on the host on every device, so it never waits
#: for the device: ``(path suffix, function) -> why``. Only needed where the step itself runs
#: on the CPU and host and device tensors cannot be told apart by their device.
HOST_TENSOR_SITES = {
    ("megatron/core/tensor_parallel/random.py", "fork"): "Megatron-Core's RNG tracker compares "
    "the CPU generator's state (torch.get_rng_state(), a host tensor) before and after its body",
}

#: Ops that copy between tensors, checked for a change of device (a copy to or from the host).
_COPY_OPS = {"aten::_to_copy", "aten::copy_", "aten::_copy_from", "aten::to"}

#: Ops that only describe or alias a tensor; they read no data and launch no kernel.
_NO_DATA_OPS = {"aten::detach", "aten::view", "aten::alias", "aten::_unsafe_view"}


@dataclass(frozen=True)
class OpRecord:
    """One dispatched op: its name and, per tensor argument, ``(shape, dtype, device type)``."""

    name: str
    tensors: tuple[tuple[tuple[int, ...], str, str], ...]


@dataclass(frozen=True)
class Hazard:
    """An op that would break capture, why, and where the Python called it (innermost frame
    outside torch)."""

    op: str
    reason: str
    where: str


@dataclass(frozen=True)
class ExternalRead:
    """A tensor an op read that the step did not create: op position, argument position,
    and its storage address."""

    op_index: int
    argument: int
    address: int


#: Frames that only pass calls through: torch itself, this module, and the CPU runtime's
#: ``TorchFunctionMode`` (:mod:`megatron_domino.runtime.cpu_runtime`).
_PASS_THROUGH = (
    "/torch/",
    "lab/analysis/capture_safety.py",
    "megatron_domino/runtime/cpu_runtime.py",
)


def _callers() -> list[traceback.FrameSummary]:
    """The frames outside :data:`_PASS_THROUGH` (the code that asked), innermost first."""
    return [
        frame
        for frame in reversed(traceback.extract_stack())
        if not any(part in frame.filename for part in _PASS_THROUGH)
    ]


def _host_tensor_site(frame: traceback.FrameSummary) -> bool:
    return any(
        frame.filename.endswith(path) and frame.name == function
        for path, function in HOST_TENSOR_SITES
    )


def _storage(tensor: torch.Tensor) -> int | None:
    """The address of ``tensor``'s storage, or ``None`` for one without (meta, subclasses)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _device_change(name: str, tensors: list[torch.Tensor], kwargs: dict) -> str | None:
    """For a copy op: ``"cuda -> cpu"`` (say) where it moves data to or from the host."""
    if name not in _COPY_OPS or not tensors:
        return None
    source = tensors[-1].device if name == "aten::copy_" else tensors[0].device
    target = tensors[0].device if name == "aten::copy_" else kwargs.get("device")
    if target is None:
        return None
    target = torch.device(target)
    if (source.type == "cpu") != (target.type == "cpu"):
        return f"{source.type} -> {target.type}"
    return None


@dataclass(eq=False)
class StepTrace(TorchDispatchMode):
    """Record every op dispatched while active (``with StepTrace() as trace: ...``).

    A host read (``_local_scalar_dense``, ``is_nonzero``) of a CPU tensor is a hazard only on
    a CPU step (where every tensor is one; :data:`HOST_TENSOR_SITES` lists the host tensors
    Megatron-Core reads there): on a CUDA step it reads host memory and waits for nothing.
    ``lift_fresh`` of a 0-dim tensor is a Python scalar (``x[mask] = 0``), which kernels take
    by value, so only tensors with dimensions count.

    Attributes:
        device_type: the device the step computes on (``"cpu"`` or ``"cuda"``).
        ops: every op in dispatch order, forward and backward, collectives included
            (``c10d::allreduce_``, ...), with its tensors' shapes, dtypes and device types.
        hazards: the ops that would make the host wait (see :data:`HOST_SYNC_OPS`) or copy
            to or from the host, with where they were called.
        external_reads: every read of a tensor whose storage no op of this trace created,
            in order: what a replay would read at its capture-time address.
    """

    device_type: str = "cpu"
    ops: list[OpRecord] = field(default_factory=list)
    hazards: list[Hazard] = field(default_factory=list)
    external_reads: list[ExternalRead] = field(default_factory=list)
    _created: set[int] = field(default_factory=set)
    _collective_depth: int = 0
    _thread: int = field(default_factory=threading.get_ident)

    def __post_init__(self) -> None:
        super().__init__()
        self._stock_wait = None

    def __enter__(self):
        self._stock_wait = stock_wait = dist.Work.wait

        def wait(work, *args, **kwargs):
            self._collective_depth += 1
            try:
                return stock_wait(work, *args, **kwargs)
            finally:
                self._collective_depth -= 1

        dist.Work.wait = wait
        return super().__enter__()

    def __exit__(self, *exc_info):
        dist.Work.wait = self._stock_wait
        return super().__exit__(*exc_info)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if self._backend_internal():
            return func(*args, **kwargs)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        self.ops.append(
            OpRecord(name, tuple((tuple(t.shape), str(t.dtype), t.device.type) for t in tensors))
        )
        reason = self._hazard(name, tensors, kwargs)
        if reason is not None:
            callers = _callers()
            if not (self.device_type == "cpu" and callers and _host_tensor_site(callers[0])):
                where = " < ".join(f"{f.filename}:{f.lineno} in {f.name}" for f in callers[:3])
                self.hazards.append(Hazard(str(func), reason, where or "?"))
        if name not in _NO_DATA_OPS:
            self._record_external_reads(name, tensors)
        collective = name.startswith("c10d::")
        self._collective_depth += collective
        try:
            result = func(*args, **kwargs)
        finally:
            self._collective_depth -= collective
        for tensor in tree_flatten(result)[0]:
            if isinstance(tensor, torch.Tensor) and (address := _storage(tensor)):
                self._created.add(address)
        return result

    def _backend_internal(self) -> bool:
        """Whether this op is a collective backend's own work, not the step's: issued inside a
        collective's dispatch or inside a ``Work.wait()`` (where gloo runs an asynchronous
        reduce-scatter's splits and copies, or not, depending on timing), or on a thread that
        is neither the one that entered the trace nor running autograd. On a GPU, NCCL
        launches one kernel per collective."""
        if threading.get_ident() != self._thread:
            return torch._C._current_graph_task_id() == -1
        return self._collective_depth > 0

    def _record_external_reads(self, name: str, tensors: list[torch.Tensor]) -> None:
        """Add the reads of tensors no op of this trace created, except host data made by the
        Python just before (``lift_fresh``'s argument) and :data:`HOST_TENSOR_SITES`' reads."""
        if name == "aten::lift_fresh":
            return
        reads = [
            ExternalRead(len(self.ops) - 1, position, address)
            for position, tensor in enumerate(tensors)
            if (address := _storage(tensor)) not in self._created and address not in (None, 0)
        ]
        if reads and self.device_type == "cpu":
            callers = _callers()
            if callers and _host_tensor_site(callers[0]):
                return
        self.external_reads += reads

    def _hazard(self, name: str, tensors: list[torch.Tensor], kwargs: dict) -> str | None:
        """Why this op would break capture, or ``None``."""
        moved = _device_change(name, tensors, kwargs)
        if moved is not None:
            return f"a copy {moved} inside the step"
        reason = HOST_SYNC_OPS.get(name)
        host_read = name in ("aten::_local_scalar_dense", "aten::is_nonzero")
        if host_read and self.device_type != "cpu" and tensors[0].device.type == "cpu":
            return None
        if name == "aten::lift_fresh" and tensors and tensors[0].dim() == 0:
            return None
        return reason

    @property
    def collectives(self) -> list[OpRecord]:
        """The c10d ops (collectives) of :attr:`ops`, in order."""
        return [op for op in self.ops if op.name.startswith("c10d::")]


def first_difference(first: list, second: list) -> str | None:
    """Where two recorded sequences (ops, external reads) first differ, or ``None``."""
    for index, (a, b) in enumerate(zip(first, second, strict=False)):
        if a != b:
            return f"entry {index}: {a} then {b}"
    if len(first) != len(second):
        return f"lengths {len(first)} then {len(second)}"
    return None
