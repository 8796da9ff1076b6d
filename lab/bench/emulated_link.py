"""An emulated interconnect for the benchmark: TP collectives through shared memory, completed
after a modelled wire time.

On two shared CPU cores a real transport (gloo over TCP, shaped or not) runs on the cores the
GEMMs use, so the benchmark measures the CPU instead of the schedule (``docs/benchmarks.md``).
On a GPU the wire is NVLink's copy engines and NCCL's kernels, not the cores the GEMMs run
on. This link keeps that property on the CPU:

* **Data** moves through a shared-memory file: at launch a rank copies its contribution into a
  ring of its own; at ``wait()`` it reads every rank's contribution and computes its output (the real reduction, in rank order, so every rank gets bit-identical results).
* **Time** is modelled: the collectives of the group run one after another on one wire, in
  launch order, as NCCL runs them on its stream. Collective ``n`` starts when the last rank
  has launched it and the wire is free, and takes ``latency + wire_bytes / bandwidth``, with
  ring-algorithm bytes per rank (:meth:`LinkModel.wire_seconds`). Every rank computes the same
  completion times from the same shared launch times, with no thread and no central clock.
* **Waiting** is a sleep until the modelled completion (and, where a peer has not launched
  yet, sleeping polls of its launch counter): no spinning thread, no socket, so the cores stay
  free for compute while a collective flies.
* **The async contract** is the real backend's: the output holds the result only once
  ``wait()`` returned (nothing is written into it before), and every launched collective must
  be waited on. A rank that fills the link (:data:`MAX_IN_FLIGHT` collectives, or its ring's
  bytes) with collectives it never waited on is refused with an error rather than deadlocked.

Its own CPU work (the copy at launch, the reduction or gather at wait, the bookkeeping) is
counted per collective in :attr:`EmulatedLink.stats` against the modelled wire time it
stands for: the emulator's cost on the compute cores, which the benchmark reports.

Test-and-bench only: nothing on the training path imports it. :func:`tp_collectives_emulated`
routes the collectives Megatron-Core and Domino call on the tensor-parallel group through it
(the same attributes the oracle arm replaces,
:data:`~megatron_domino.runtime.tp_collectives.TP_COLLECTIVES`); calls on other groups
run on the real backend.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import mmap
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_domino.runtime.tp_collectives import COLLECTIVE_KINDS, swapped_tp_collectives

__all__ = ["EmulatedLink", "LinkEvent", "LinkModel", "LinkStats", "tp_collectives_emulated"]

#: Collectives a rank may have launched and that some rank has not yet read (per group).
MAX_IN_FLIGHT = 1024
#: Every contribution starts on a multiple of this, so every dtype's view of it is aligned.
_ALIGN = 64
#: How long a rank sleeps between looks at a peer that has not launched yet or not yet read.
_POLL_S = 20e-6
#: A peer that has not launched a collective after this long is taken for a hang.
_PEER_TIMEOUT_S = 600.0
#: Control words per rank: the last sequence number launched, and the last one up to which
#: it has read every collective.
_POSTED, _CONSUMED = 0, 1
_RANK_WORDS = 2
#: Words per rank and in-flight collective: its launch time (ns), its bytes.
_LAUNCH_NS, _NBYTES = 0, 1
_LAUNCH_WORDS = 2
#: ``reduce(a, b, out=...)`` per reduction op.
_REDUCE_OPS = {
    dist.ReduceOp.SUM: torch.add,
    dist.ReduceOp.MAX: torch.maximum,
    dist.ReduceOp.MIN: torch.minimum,
}


@dataclass(frozen=True)
class LinkModel:
    """The wire: one per group, serving its collectives one at a time in launch order.

    Args:
        bandwidth_bytes_s: bytes per second each rank sends (a ring's per-link rate).
        latency_s: fixed cost of every collective (NCCL's launch and protocol latency, scaled).
    """

    bandwidth_bytes_s: float
    latency_s: float = 50e-6

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_s > 0 or self.latency_s < 0:
            raise ValueError(
                f"an emulated link needs a positive bandwidth and a latency >= 0; got "
                f"{self.bandwidth_bytes_s} B/s and {self.latency_s} s"
            )

    @classmethod
    def from_mbit(cls, mbit_s: float, latency_s: float = 50e-6) -> LinkModel:
        return cls(mbit_s * 1e6 / 8, latency_s)

    def wire_seconds(self, kind: str, tensor_bytes: int, world: int) -> float:
        """Modelled time of one collective on the ring algorithm.

        ``tensor_bytes`` is what one rank contributes: the all-reduced tensor, the gathered
        shard, or the full input of a reduce-scatter. Each rank sends ``2 (n-1)/n`` of an
        all-reduced tensor, ``n-1`` shards of an all-gather, ``(n-1)/n`` of a reduce-scatter's
        input.
        """
        share = {
            "all_reduce": 2 * (world - 1) / world,
            "all_gather": world - 1,
            "reduce_scatter": (world - 1) / world,
        }[kind]
        return self.latency_s + share * tensor_bytes / self.bandwidth_bytes_s


@dataclass
class LinkStats:
    """What the link did: collectives, modelled wire seconds, its own CPU seconds, and per
    phase label (:attr:`EmulatedLink.phase`) the seconds its callers spent blocked in waits:
    ``blocked_s`` once every rank had launched the collective (on the wire, behind it or the
    collectives before it: the communication the caller's schedule left exposed), and
    ``peer_wait_s`` before the last rank launched it (the ranks out of step: on two shared
    cores mostly one rank's compute running slower than the other's)."""

    collectives: int = 0
    wire_s: float = 0.0
    cpu_s: float = 0.0
    by_kind: dict[str, int] = field(default_factory=dict)
    blocked_s: dict[str, float] = field(default_factory=dict)
    peer_wait_s: dict[str, float] = field(default_factory=dict)

    @property
    def cpu_per_wire(self) -> float:
        """The emulator's CPU time over the wire time it modelled (the target is < 0.05)."""
        return self.cpu_s / self.wire_s if self.wire_s > 0 else float("nan")

    def as_dict(self) -> dict:
        return {
            "collectives": self.collectives,
            "wire_s": self.wire_s,
            "cpu_s": self.cpu_s,
            "cpu_per_wire": self.cpu_per_wire,
            "by_kind": dict(self.by_kind),
            "blocked_s": dict(self.blocked_s),
            "peer_wait_s": dict(self.peer_wait_s),
        }


@dataclass
class _Launched:
    """One launched collective: its order on the wire, what it moves, how it completes."""

    sequence: int
    kind: str
    offset: int
    nbytes: int
    source_dtype: torch.dtype
    source_shape: torch.Size
    finish: Callable[[list[torch.Tensor]], None]
    launch_ns: int
    caller: str
    done: bool = False


@dataclass(frozen=True)
class LinkEvent:
    """One collective's life on this rank (``time.monotonic_ns`` clock): launched, launched by
    the last rank at ``last_launch_ns``, on the wire from ``wire_start_ns`` to
    ``wire_end_ns``, waited from ``wait_begin_ns`` to
    ``wait_end_ns`` (the time the caller was blocked), in ``phase``
    (:attr:`EmulatedLink.phase` at the wait). ``caller`` names the code that launched it
    (``module:qualified function``, and the nearest ``torch.nn.Module`` up the stack)."""

    sequence: int
    kind: str
    nbytes: int
    caller: str
    phase: str
    launch_ns: int
    last_launch_ns: int
    wire_start_ns: int
    wire_end_ns: int
    wait_begin_ns: int
    wait_end_ns: int


class _EmulatedWork:
    """The handle of an ``async_op=True`` collective on the emulated link."""

    def __init__(self, link: EmulatedLink, launched: _Launched) -> None:
        self._link = link
        self._launched = launched

    def wait(self, timeout=None) -> bool:
        self._link.complete(self._launched)
        return True

    def is_completed(self) -> bool:
        return self._launched.done or self._link.wire_done(self._launched)


class EmulatedLink:
    """The emulated interconnect of one process group (module docstring).

    Built collectively by every rank of ``group`` (it broadcasts the shared file's name on the
    group's real backend). Each rank's contributions go into a ring of ``capacity_bytes`` in
    the shared file, in launch order; every rank launches the same collectives with the same
    sizes, so a contribution lies at the same offset of every rank's ring. The file is mapped
    with its pages populated, so no collective pays a page fault.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        model: LinkModel,
        capacity_bytes: int,
        *,
        trace: bool = False,
    ) -> None:
        self.group = group
        self.model = model
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.capacity = _aligned(capacity_bytes)
        self.stats = LinkStats()
        #: With ``trace``, one :class:`LinkEvent` per completed collective, in completion order.
        self.trace: list[LinkEvent] | None = [] if trace else None
        #: A label the caller sets (``fwd``, ``bwd``): waits are counted per label.
        self.phase = ""
        words = self.world * (_RANK_WORDS + MAX_IN_FLIGHT * _LAUNCH_WORDS)
        control_bytes = _aligned(words * 8)
        self._map = _shared_map(group, control_bytes + self.world * self.capacity)
        self._words = memoryview(self._map)[: words * 8].cast("q")
        self._data = torch.frombuffer(self._map, dtype=torch.uint8, offset=control_bytes)
        for rank in range(self.world):
            self._words[self._word(rank, _POSTED)] = -1
            self._words[self._word(rank, _CONSUMED)] = -1
        dist.barrier(group=group)
        self._launched = 0
        self._resolved = 0
        self._head = 0
        self._wire_free_ns = 0
        # Per resolved collective: (last rank's launch, wire start, wire end), in ns.
        self._wire_ns: dict[int, tuple[int, int, int]] = {}
        self._pending: dict[int, _Launched] = {}
        self._in_ring: collections.deque[tuple[int, int]] = collections.deque()
        self._read: set[int] = set()

    # Collectives, with torch.distributed's contract.

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False):
        reduce = _reduce_op(op)
        target = _backend_alias(tensor)

        def finish(sources: list[torch.Tensor]) -> None:
            if self.world == 2:
                # The tensor still holds this rank's contribution (the caller may not write it
                # while in flight, as with NCCL), and a + b == b + a exactly: one pass less.
                reduce(target, sources[1 - self.rank], out=target)
                return
            reduce(sources[0], sources[1], out=target)
            for other in sources[2:]:
                reduce(target, other, out=target)

        return self._run("all_reduce", tensor, finish, async_op)

    def all_gather_into_tensor(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False
    ):
        if output.numel() != input.numel() * self.world or not output.is_contiguous():
            raise ValueError(
                f"all_gather_into_tensor needs a contiguous output of {self.world} x the input's "
                f"elements; got {tuple(output.shape)} for {tuple(input.shape)}"
            )
        target = _backend_alias(output)

        def finish(sources: list[torch.Tensor]) -> None:
            for rank, part in enumerate(target.view(self.world, -1)):
                part.copy_(sources[rank].reshape(-1))

        return self._run("all_gather", input, finish, async_op)

    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, async_op=False
    ):
        reduce = _reduce_op(op)
        if input.numel() != output.numel() * self.world:
            raise ValueError(
                f"reduce_scatter_tensor needs an input of {self.world} x the output's elements; "
                f"got {tuple(input.shape)} for {tuple(output.shape)}"
            )
        target = _backend_alias(output).view(-1)

        def finish(sources: list[torch.Tensor]) -> None:
            mine = [source.reshape(self.world, -1)[self.rank] for source in sources]
            reduce(mine[0], mine[1], out=target)
            for other in mine[2:]:
                reduce(target, other, out=target)

        return self._run("reduce_scatter", input, finish, async_op)

    # Launch and completion.

    def _run(self, kind: str, source: torch.Tensor, finish, async_op: bool):
        if self.world == 1:
            raise ValueError("the emulated link needs a group of two or more ranks")
        launched = self.launch(kind, source, finish)
        if async_op:
            return _EmulatedWork(self, launched)
        self.complete(launched)
        return None

    def launch(self, kind: str, source: torch.Tensor, finish) -> _Launched:
        """Copy ``source`` into this rank's ring and post its launch time."""
        cpu = time.thread_time()
        sequence = self._launched
        nbytes = source.numel() * source.element_size()
        offset = self._allocate(sequence, nbytes)
        self._contribution(self.rank, offset, nbytes).view(source.dtype).view(source.shape).copy_(
            source
        )
        launch_ns = time.monotonic_ns()
        self._words[self._launch_word(self.rank, sequence, _NBYTES)] = nbytes
        self._words[self._launch_word(self.rank, sequence, _LAUNCH_NS)] = launch_ns
        self._words[self._word(self.rank, _POSTED)] = sequence
        self._launched += 1
        caller = _caller() if self.trace is not None else ""
        launched = _Launched(
            sequence, kind, offset, nbytes, source.dtype, source.shape, finish, launch_ns, caller
        )
        self._pending[sequence] = launched
        self.stats.collectives += 1
        self.stats.by_kind[kind] = self.stats.by_kind.get(kind, 0) + 1
        self.stats.cpu_s += time.thread_time() - cpu
        return launched

    def complete(self, launched: _Launched) -> None:
        """Sleep until ``launched`` has left the wire, then compute this rank's output."""
        if launched.done:
            return
        wait_begin = time.monotonic_ns()
        self._resolve_through(launched.sequence)
        delay = (self._wire_ns[launched.sequence][2] - time.monotonic_ns()) / 1e9
        if delay > 0:
            time.sleep(delay)
        wait_end = time.monotonic_ns()
        last_launch = self._wire_ns[launched.sequence][0]
        peer_wait = max(0, min(wait_end, last_launch) - wait_begin)
        for seconds, counted in (
            ((wait_end - wait_begin - peer_wait) / 1e9, self.stats.blocked_s),
            (peer_wait / 1e9, self.stats.peer_wait_s),
        ):
            counted[self.phase] = counted.get(self.phase, 0.0) + seconds
        cpu = time.thread_time()
        sources = [
            self._contribution(rank, launched.offset, launched.nbytes)
            .view(launched.source_dtype)
            .view(launched.source_shape)
            for rank in range(self.world)
        ]
        with torch.no_grad():
            launched.finish(sources)
        launched.done = True
        del self._pending[launched.sequence]
        wire = self._wire_ns.pop(launched.sequence)
        self._mark_read(launched.sequence)
        self.stats.cpu_s += time.thread_time() - cpu
        if self.trace is not None:
            self.trace.append(
                LinkEvent(
                    launched.sequence,
                    launched.kind,
                    launched.nbytes,
                    launched.caller,
                    self.phase,
                    launched.launch_ns,
                    *wire,
                    wait_begin,
                    wait_end,
                )
            )

    def wire_done(self, launched: _Launched) -> bool:
        """Whether ``launched`` has left the wire (without waiting for peers to launch)."""
        if not self._launched_by_all(launched.sequence):
            return False
        self._resolve_through(launched.sequence)
        return time.monotonic_ns() >= self._wire_ns[launched.sequence][2]

    def _resolve_through(self, sequence: int) -> None:
        """Completion times of every collective up to ``sequence``, in wire order.

        Each starts once every rank launched it and the one before left the wire; every rank
        computes the same numbers from the same shared launch times.
        """
        while self._resolved <= sequence:
            current = self._resolved
            launched = self._pending[current]
            self._sleep_until(
                functools.partial(self._launched_by_all, current),
                f"rank(s) to launch collective #{current} ({launched.kind})",
            )
            sizes = [self._words[self._launch_word(r, current, _NBYTES)] for r in range(self.world)]
            if len(set(sizes)) != 1:
                raise RuntimeError(
                    f"ranks launched different collectives as #{current} ({launched.kind}): "
                    f"{sizes} bytes per rank; every rank must launch the same collectives in "
                    "the same order"
                )
            launches = (self._launch_word(r, current, _LAUNCH_NS) for r in range(self.world))
            last_launch = max(self._words[word] for word in launches)
            start = max(last_launch, self._wire_free_ns)
            wire_s = self.model.wire_seconds(launched.kind, launched.nbytes, self.world)
            self._wire_free_ns = start + round(wire_s * 1e9)
            self._wire_ns[current] = (last_launch, start, self._wire_free_ns)
            self.stats.wire_s += wire_s
            self._resolved += 1

    def _allocate(self, sequence: int, nbytes: int) -> int:
        """The ring offset of collective ``sequence``'s ``nbytes``, once every rank has read
        what was there before (and the launch words it reuses)."""
        size = _aligned(nbytes)
        if size > self.capacity:
            raise ValueError(
                f"a collective of {nbytes} bytes per rank exceeds the emulated link's ring of "
                f"{self.capacity} bytes; build the link with a larger capacity_bytes"
            )
        start = self._head
        if start % self.capacity + size > self.capacity:
            start += self.capacity - start % self.capacity
        self._head = start + size
        must_be_read = sequence - MAX_IN_FLIGHT
        while self._in_ring and self._in_ring[0][1] < self._head - self.capacity:
            must_be_read = max(must_be_read, self._in_ring.popleft()[0])
        self._in_ring.append((sequence, start))
        if must_be_read >= 0:
            self._wait_read_by_all(must_be_read)
        return start % self.capacity

    def _mark_read(self, sequence: int) -> None:
        """Advance this rank's published read mark over every collective read in order."""
        self._read.add(sequence)
        consumed = self._words[self._word(self.rank, _CONSUMED)]
        while consumed + 1 in self._read:
            consumed += 1
            self._read.remove(consumed)
        self._words[self._word(self.rank, _CONSUMED)] = consumed

    def _wait_read_by_all(self, sequence: int) -> None:
        """Block until every rank has read collective ``sequence`` and all before it."""
        if self._words[self._word(self.rank, _CONSUMED)] < sequence:
            raise RuntimeError(
                f"the emulated link is full ({MAX_IN_FLIGHT} collectives or "
                f"{self.capacity} bytes per rank) with collective #{sequence} never waited on "
                "this rank: wait on every async collective, as NCCL requires too, or build "
                "the link with a larger capacity_bytes"
            )
        self._sleep_until(
            lambda: all(
                self._words[self._word(rank, _CONSUMED)] >= sequence for rank in range(self.world)
            ),
            f"rank(s) to read collective #{sequence} before its bytes are reused",
        )

    def _sleep_until(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + _PEER_TIMEOUT_S
        while not ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"emulated link: waited {_PEER_TIMEOUT_S:.0f} s for {what}")
            time.sleep(_POLL_S)

    # Layout of the shared file: control words, then each rank's ring.

    def _word(self, rank: int, which: int) -> int:
        return rank * _RANK_WORDS + which

    def _launch_word(self, rank: int, sequence: int, which: int) -> int:
        entry = rank * MAX_IN_FLIGHT + sequence % MAX_IN_FLIGHT
        return self.world * _RANK_WORDS + entry * _LAUNCH_WORDS + which

    def _launched_by_all(self, sequence: int) -> bool:
        return all(self._words[self._word(r, _POSTED)] >= sequence for r in range(self.world))

    def _contribution(self, rank: int, offset: int, nbytes: int) -> torch.Tensor:
        start = rank * self.capacity + offset
        return self._data[start : start + nbytes]


#: Frames :func:`_caller` looks through: this module's, ``torch.distributed``'s, and Domino's
#: generic launch machinery (its caller says which collective it is).
_PLUMBING = (
    __name__,
    "torch.distributed",
    "megatron_domino.communication.collectives",
    "torch.autograd",
)


def _caller() -> str:
    """``module:qualified function`` of the first frame outside :data:`_PLUMBING`, and the
    class of the nearest ``torch.nn.Module`` method above it."""
    frame, caller = sys._getframe(2), ""
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not caller and not module.startswith(_PLUMBING):
            caller = f"{module}:{frame.f_code.co_qualname}"
        owner = frame.f_locals.get("self") if caller else None
        if isinstance(owner, torch.nn.Module):
            return f"{caller} in {type(owner).__name__}"
        frame = frame.f_back
    return caller


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _backend_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor on ``tensor``'s memory with a version counter of its own.

    A backend writes a collective's output outside autograd: NCCL and gloo do not bump the
    tensor's version, so a tensor autograd saved (or a custom Function's output, as Domino's
    in-flight all-reduce is) may receive the result. Writing through this alias keeps that
    contract; writing into ``tensor`` itself would trip autograd's in-place checks.
    """
    alias = tensor.new_empty(0)
    return alias.set_(
        tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride()
    )


def _reduce_op(op) -> Callable:
    try:
        return _REDUCE_OPS[op]
    except KeyError:
        raise ValueError(f"the emulated link reduces with SUM, MAX or MIN, not {op}") from None


def _shared_map(group: dist.ProcessGroup, nbytes: int) -> mmap.mmap:
    """A shared mapping of ``nbytes`` that every rank of ``group`` opens.

    The group's first rank creates the file in ``/dev/shm`` and broadcasts its name; every rank
    maps it with its pages populated (a page fault per 4 KiB would otherwise cost each
    collective more than its copy); once every rank has mapped it, the file is unlinked, so
    nothing is left behind however the run ends.
    """
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
    name = [None]
    if dist.get_rank(group) == 0:
        folder = directory or os.environ.get("TMPDIR", "/tmp")
        name[0] = os.path.join(folder, f"megatron-domino-link-{uuid.uuid4().hex}")
        with open(name[0], "wb") as created:
            created.truncate(nbytes)
    dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0), group=group)
    with open(name[0], "r+b") as opened:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mapping = mmap.mmap(opened.fileno(), nbytes, flags=flags)
    dist.barrier(group=group)
    if dist.get_rank(group) == 0:
        os.unlink(name[0])
    return mapping


def _routed(original, kind: str, link: EmulatedLink):
    """``original``, sent to ``link`` when called on its group; other groups run as they did.

    Arguments are bound by ``torch.distributed``'s own parameter names, whether passed by
    position or by name; the wrapper keeps that signature (``functools.wraps``) for wrappers
    of its own, such as the comm-only arm's logging.
    """
    signature = inspect.signature(original)
    method = {
        "all_reduce": link.all_reduce,
        "all_gather": link.all_gather_into_tensor,
        "reduce_scatter": link.reduce_scatter_tensor,
    }[kind]

    @functools.wraps(original)
    def collective(*args, group=None, async_op=False, **kwargs):
        if group is not link.group:
            return original(*args, group=group, async_op=async_op, **kwargs)
        arguments = list(signature.bind(*args, **kwargs).arguments.values())
        return method(*arguments, async_op=async_op)

    return collective


@contextlib.contextmanager
def tp_collectives_emulated(link: EmulatedLink) -> Iterator[EmulatedLink]:
    """Within the block, the TP collectives on ``link.group`` run on the emulated link."""
    with swapped_tp_collectives(
        lambda name, original: _routed(original, COLLECTIVE_KINDS[name], link)
    ):
        yield link
