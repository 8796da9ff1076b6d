"""Host time against device time of the transformer block's forward and backward.

Domino runs each layer's Python once per chunk, so it issues about ``p`` times stock's kernel
launches. Where the host takes longer to issue a step than the device takes to run it, the
device waits on the host (*launch-bound*) and the overlap Domino won is handed back. This
module measures the two sides of one block step (``decoder(...)`` then ``backward``), with
the tensor-parallel collectives made no-ops by the caller:

* **host time**: ``time.perf_counter`` from the call to the return of ``backward`` (no
  synchronisation inside), the device running concurrently, as in training;
* **device time** (CUDA): the same step enqueued behind a sleep kernel long enough to cover
  the host's issuing, CUDA events after the sleep and after the step: the device's work with
  no gap waiting for the host (assuming the launch queue does not fill; the host time of
  that pass is reported too, and a much longer one means it did);
* **dispatched ops**: aten operators the step dispatches (:func:`dispatched_ops`), the
  host-side work counted without a clock.

On the CPU there is no device time: the host time is the wall clock of the whole computation.
Shapes: the block's input ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism), its
mask ``[1, 1, s, s]``, the rotary embedding ``[s, 1, 1, d]``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_domino.engine.chunking import causal_attention_mask

__all__ = ["StepTimes", "block_step", "dispatched_ops", "time_step"]


@dataclass(frozen=True)
class StepTimes:
    """Medians over the measured iterations, milliseconds per step.

    Attributes:
        host_ms: host time with the device running alongside.
        device_ms: device time of the step's work (``None`` on the CPU).
        queued_host_ms: host time of the pass behind the sleep kernel (``None`` on the CPU).
    """

    host_ms: float
    device_ms: float | None
    queued_host_ms: float | None


def block_step(model: torch.nn.Module, micro_batch: int) -> Callable[[], None]:
    """One forward and backward of ``model``'s transformer block (``GPTModel.decoder``) on a
    random input ``[s, b, h]`` of the model's dtype and device, with its causal mask and, for
    rotary models, the rotary embedding, as ``GPTModel.forward`` would pass them."""
    bare = getattr(model, "module", model)
    config = bare.config
    parameter = next(bare.decoder.parameters())
    s = bare.max_sequence_length
    if config.sequence_parallel:
        s //= config.tensor_model_parallel_size
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(s, micro_batch, config.hidden_size, generator=generator)
    hidden = hidden.to(parameter.device, parameter.dtype).requires_grad_(True)
    grad = torch.randn_like(hidden)
    inputs = {"attention_mask": causal_attention_mask(bare.max_sequence_length, parameter.device)}
    if getattr(bare, "rotary_pos_emb", None) is not None:
        inputs["rotary_pos_emb"] = bare.rotary_pos_emb(bare.max_sequence_length)

    def step() -> None:
        hidden.grad = None
        bare.decoder(hidden_states=hidden, **inputs).backward(grad)

    return step


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def dispatched_ops(step: Callable[[], None]) -> int:
    """Aten operators one call of ``step`` dispatches (forward and backward)."""
    with _OpCounter() as counter:
        step()
    return counter.count


def _sleep_cycles_per_ms() -> float:
    """GPU clock cycles ``torch.cuda._sleep`` spins per millisecond, measured."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def time_step(step: Callable[[], None], *, cuda: bool, warmup: int, iters: int) -> StepTimes:
    """Median host (and, with ``cuda``, device) milliseconds of ``step`` (module docstring)."""
    host, device, queued = [], [], []
    cycles_per_ms = _sleep_cycles_per_ms() if cuda else 0.0
    for iteration in range(warmup + iters):
        if cuda:
            torch.cuda.synchronize()
        begin = time.perf_counter()
        step()
        host_ms = (time.perf_counter() - begin) * 1e3
        if cuda:
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            # Long enough for the host to issue the whole step before the device starts it.
            torch.cuda._sleep(int(cycles_per_ms * (3 * host_ms + 5)))
            start.record()
            begin = time.perf_counter()
            step()
            queued_ms = (time.perf_counter() - begin) * 1e3
            end.record()
            end.synchronize()
        if iteration >= warmup:
            host.append(host_ms)
            if cuda:
                device.append(start.elapsed_time(end))
                queued.append(queued_ms)
    return StepTimes(
        host_ms=statistics.median(host),
        device_ms=statistics.median(device) if cuda else None,
        queued_host_ms=statistics.median(queued) if cuda else None,
    )
