"""Time a rank spends blocked on tensor-parallel collectives, stock or Domino alike.

Domino's recorder sees only Domino's own collectives; stock Megatron-Core's TP collectives
(the synchronous all-reduces of the row-parallel linears, the sequence-parallel gathers and
reduce-scatters, the column-parallel backward's asynchronous all-reduce that flies during the
weight-gradient GEMM) and those outside the transformer block (the vocab-parallel embedding
and cross entropy) are not labelled. :class:`TPWaitClock` measures all of them the same way
for both arms of ``--domino-ab``: while :meth:`TPWaitClock.measuring` is active, the
collective functions the TP code calls are wrapped, and for each call on the TP group

* a synchronous call counts whole (the caller is blocked until it returns);
* an ``async_op=True`` call counts from the begin to the end of its handle's ``wait()``.

Times are taken like the recorder's: CUDA events on the current stream on a GPU (the stream
stalls for the collective, so the interval is device time), the wall clock on the CPU.
Collectives on other groups (data-parallel gradient reduction, pipeline sends) pass through
uncounted. The wrapped names are those the TP code looks up at call time,
:data:`~megatron_domino.runtime.tp_collectives.TP_COLLECTIVES`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from collections.abc import Callable, Iterator

import torch
from megatron.core import parallel_state

from megatron_domino.runtime.tp_collectives import swapped_tp_collectives

__all__ = ["TPWaitClock"]


class _Interval:
    """One blocked interval: started at construction, ended by :meth:`end`."""

    def __init__(self, cuda: bool) -> None:
        self._cuda = cuda
        if cuda:
            self._start, self._end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            self._start.record()
        else:
            self._start_s = time.perf_counter()

    def end(self) -> None:
        if self._cuda:
            self._end.record()
        else:
            self._end_s = time.perf_counter()

    def seconds(self) -> float:
        """Its length (on a GPU after a device synchronisation)."""
        if self._cuda:
            return self._start.elapsed_time(self._end) / 1e3
        return self._end_s - self._start_s


class _TimedWork:
    """An ``async_op`` handle whose ``wait()`` is timed; everything else is the handle's."""

    def __init__(self, work, intervals: list[_Interval], cuda: bool) -> None:
        self._work, self._intervals, self._cuda = work, intervals, cuda

    def wait(self, *args, **kwargs):
        interval = _Interval(self._cuda)
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            interval.end()
            self._intervals.append(interval)

    def __getattr__(self, name: str):
        return getattr(self._work, name)


class TPWaitClock:
    """Sums the time this rank is blocked on TP collectives inside :meth:`measuring`."""

    def __init__(self) -> None:
        self._intervals: list[_Interval] = []
        self._cuda = torch.cuda.is_available()

    def _timed(self, collective: Callable) -> Callable:
        signature = inspect.signature(collective)

        @functools.wraps(collective)
        def call(*args, **kwargs):
            bound = signature.bind_partial(*args, **kwargs).arguments
            if bound.get("group") is not parallel_state.get_tensor_model_parallel_group():
                return collective(*args, **kwargs)
            if bound.get("async_op"):
                work = collective(*args, **kwargs)
                return None if work is None else _TimedWork(work, self._intervals, self._cuda)
            interval = _Interval(self._cuda)
            try:
                return collective(*args, **kwargs)
            finally:
                interval.end()
                self._intervals.append(interval)

        return call

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """Count the TP waits of the body (one optimizer step); read them with :meth:`take`."""
        why = "time TP waits (--domino-ab)"
        with swapped_tp_collectives(lambda _name, original: self._timed(original), why):
            yield

    def take(self) -> float:
        """Seconds blocked since the last call (synchronise the device first on a GPU)."""
        seconds = sum(interval.seconds() for interval in self._intervals)
        self._intervals.clear()
        return seconds
