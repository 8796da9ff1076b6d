"""NCCL's async contract enforced on gloo: what a GPU run would get wrong, caught on the CPU.

On NCCL an ``async_op=True`` collective runs on its own stream: until ``wait()`` its output
holds anything (the old values, half the sum), its input must not be written (NCCL may still
read it), and a handle never waited leaves the output unsynchronised. Gloo's threads usually
finish before the caller looks, which hides all three. :class:`NcclHazards` makes them show:

* **outputs poisoned until wait**: the real collective runs (still asynchronously) on private
  buffers; the caller's output is filled with NaN (integers: their largest value) at launch
  and receives the result only in ``wait()``. Reading it early puts NaN into the loss or a
  gradient, which a comparison against stock then flags;
* **inputs snapshotted at launch, compared at wait**: an input whose values or autograd
  version counter changed in between, or an in-place collective's buffer written while in
  flight (no longer all poison), is a violation;
* **unwaited handles listed at the end of a step** (:meth:`NcclHazards.end_step`), with the
  file and line that launched them;
* **one queue per communicator**: NCCL runs the collectives of one communicator in the order
  they were issued, so a blocking collective issued while async ones are in flight on the same
  group (Transformer Engine's amax all-reduce of a current-scaling cast, ``->wait()``) waits
  for all of them: the overlap they were launched for is serialised. Here such a call waits
  for the earlier ones' real collectives first and is listed (:attr:`StepHazards.serialised`),
  with the file and line that issued it and how many it queued behind.

The caller's buffers are written through ``.data``, as NCCL writes them behind autograd's
back: no version counter moves. Wrapped, in ``torch.distributed`` and in every already-imported
``megatron``/``megatron_domino`` module that bound one of them to a name of its own (Megatron's
``dist_all_gather_func``): the functions of :data:`COLLECTIVES`. Point-to-point ``isend`` and
``irecv`` are not wrapped: Megatron's pipeline schedule waits them in the call that starts
them (``--overlap-p2p-communication`` aside, which Domino does not touch). Synchronous calls
pass straight through.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["COLLECTIVES", "NcclHazards", "StepHazards"]

#: Wrapped collective -> (its input arguments, its output arguments); an argument in both is
#: reduced in place. List arguments (``all_gather``'s ``tensor_list``) hold output tensors.
COLLECTIVES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "all_reduce": (("tensor",), ("tensor",)),
    "broadcast": (("tensor",), ("tensor",)),
    "all_gather_into_tensor": (("input_tensor",), ("output_tensor",)),
    "_all_gather_base": (("input_tensor",), ("output_tensor",)),
    "all_gather": (("tensor",), ("tensor_list",)),
    "reduce_scatter_tensor": (("input",), ("output",)),
    "_reduce_scatter_base": (("input",), ("output",)),
}

_OWN_FILES = (__file__, "torch/distributed/")
_MODULES = ("torch.distributed", "megatron", "megatron_domino")


@dataclass
class StepHazards:
    """What one step (e.g. one forward and backward) did with async collectives.

    Attributes:
        label: the step's name.
        launches: async launches by the package that made them (``megatron_domino``,
            ``megatron``, ...).
        unwaited: launch sites (``file:line in function: collective``) never waited.
        violations: inputs changed or in-place buffers written while in flight.
    """

    label: str
    launches: Counter = field(default_factory=Counter)
    unwaited: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    #: Blocking collectives issued on a group with async ones in flight (queued behind them).
    serialised: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.unwaited and not self.violations


def _poison(tensor: torch.Tensor) -> None:
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.data.fill_(float("nan"))
    elif tensor.dtype != torch.bool:
        tensor.data.fill_(torch.iinfo(tensor.dtype).max)


def _still_poison(tensor: torch.Tensor) -> bool:
    if tensor.is_floating_point() or tensor.is_complex():
        return bool(tensor.isnan().all())
    if tensor.dtype == torch.bool:
        return True
    return bool((tensor == torch.iinfo(tensor.dtype).max).all())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equal values (NaN equal to NaN)."""
    if a.is_floating_point():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _caller() -> tuple[str, str]:
    """(package, ``file:line in function``) of the frame that called the collective."""
    for frame in reversed(traceback.extract_stack()):
        if not any(own in frame.filename for own in _OWN_FILES):
            path = frame.filename.replace("\\", "/")
            for package in ("megatron_domino", "megatron", "tests"):
                marker = f"/{package}/"
                if marker in path:
                    short = package + "/" + path.split(marker, 1)[1]
                    return package, f"{short}:{frame.lineno} in {frame.name}"
            return "other", f"{path}:{frame.lineno} in {frame.name}"
    return "other", "?"


class _Launch:
    """One async collective in flight, and the handle its caller gets instead of ``Work``.

    Holds the caller's inputs (with their values and version counters at launch), the
    caller's outputs and the private tensors the real collective writes instead.
    """

    def __init__(self, hazards, name, site, work, inputs, outputs, private, group):
        self.hazards, self.name, self.site, self.work = hazards, name, site, work
        self.group = group
        #: (argument, caller's tensor, its values at launch, its version after the poison)
        self.inputs = [(a, t, snapshot, t._version) for a, t, snapshot in inputs]
        self.outputs = list(zip(outputs, private, strict=True))
        self.waited = False

    def wait(self, timeout=None) -> bool:
        if not self.waited:
            self.work.wait() if timeout is None else self.work.wait(timeout)
            self.waited = True
            self.hazards._finish(self)
        return True

    def is_completed(self) -> bool:
        return self.waited

    def get_future(self):
        raise NotImplementedError(
            f"{self.name} under tests/nccl_hazards.py: futures of async collectives are not "
            "emulated; wait() on the handle instead."
        )


class NcclHazards:
    """Install the wrappers (:meth:`installed`), run steps, read each with :meth:`end_step`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inside = threading.local()
        self._in_flight: list[_Launch] = []
        self._step = StepHazards("")

    @contextlib.contextmanager
    def installed(self) -> Iterator[NcclHazards]:
        """Replace every :data:`COLLECTIVES` function wherever it is bound; restore on exit."""
        originals = {id(getattr(dist, name)): (name, getattr(dist, name)) for name in COLLECTIVES}
        wrappers = {key: self._wrap(name, fn) for key, (name, fn) in originals.items()}
        replaced = []
        for module_name, module in list(sys.modules.items()):
            if module is None or not module_name.startswith(_MODULES):
                continue
            for attribute, value in list(vars(module).items()):
                if id(value) in originals and value is originals[id(value)][1]:
                    replaced.append((module, attribute, value))
                    setattr(module, attribute, wrappers[id(value)])
        try:
            yield self
        finally:
            for module, attribute, value in replaced:
                setattr(module, attribute, value)

    def end_step(self, label: str) -> StepHazards:
        """What the step since the last call did; every handle still in flight is listed as
        unwaited (and forgotten, so the next step starts clean)."""
        with self._lock:
            step, self._step = self._step, StepHazards(label)
            step.label = label
            step.unwaited = [f"{launch.site}: {launch.name}" for launch in self._in_flight]
            self._in_flight = []
        return step

    def _wrap(self, name: str, collective):
        signature = inspect.signature(collective)

        @functools.wraps(collective)
        def wrapper(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            if getattr(self._inside, "on", False):
                return collective(*args, **kwargs)
            if not bound.arguments.get("async_op"):
                self._queue_behind_in_flight(name, bound.arguments.get("group"))
                return collective(*args, **kwargs)
            self._inside.on = True
            try:
                return self._launch(name, collective, bound.arguments)
            finally:
                self._inside.on = False

        return wrapper

    def _launch(self, name: str, collective, arguments: dict) -> _Launch:
        package, site = _caller()
        input_names, output_names = COLLECTIVES[name]
        real = dict(arguments)
        outputs, private = [], []
        for argument in output_names:
            value = arguments[argument]
            mine = list(value) if isinstance(value, list | tuple) else [value]
            theirs = [tensor.detach().clone() for tensor in mine]
            outputs += mine
            private += theirs
            real[argument] = theirs if isinstance(value, list | tuple) else theirs[0]
        inputs = []
        for argument in input_names:
            tensor = arguments[argument]
            inputs.append((argument, tensor, tensor.detach().clone()))
            if argument not in output_names:  # the real collective never reads the caller's
                real[argument] = tensor.detach().clone()
        work = collective(**real)
        for tensor in outputs:
            _poison(tensor)
        launch = _Launch(self, name, site, work, inputs, outputs, private, _group_key(real))
        with self._lock:
            self._step.launches[package] += 1
            self._in_flight.append(launch)
        return launch

    def _queue_behind_in_flight(self, name: str, group) -> None:
        """A blocking collective on ``group``: as on one NCCL communicator, it completes only
        after every async collective issued before it on that group; listed when there were."""
        key = _group_key({"group": group})
        with self._lock:
            ahead = [launch for launch in self._in_flight if launch.group == key]
            if ahead:
                _, site = _caller()
                self._step.serialised.append(f"{site}: {name} behind {len(ahead)} in flight")
        for launch in ahead:
            launch.work.wait()

    def _finish(self, launch: _Launch) -> None:
        _, output_names = COLLECTIVES[launch.name]
        problems = []
        for argument, tensor, snapshot, version in launch.inputs:
            in_place = argument in output_names
            if tensor._version != version:
                problems.append(f"its {argument} was modified in place while in flight")
            elif in_place and not _still_poison(tensor):
                problems.append(f"its in-place buffer {argument} was written while in flight")
            elif not in_place and not _same(tensor, snapshot):
                problems.append(f"its input {argument} changed while in flight")
        for output, private in launch.outputs:
            output.data.copy_(private)
        with self._lock:
            if launch in self._in_flight:
                self._in_flight.remove(launch)
            self._step.violations += [f"{launch.site}: {launch.name}: {p}" for p in problems]


def _group_key(arguments: dict):
    """The communicator a collective runs on: its ``group`` (``None``: the default group's)."""
    group = arguments.get("group")
    return id(group if group is not None else dist.group.WORLD)
