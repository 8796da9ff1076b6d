"""One benchmark rank: time the arms side by side on the same model, weights and batch.

Run under ``torchrun`` (the launcher in :mod:`lab.bench.__main__` does it inside a
rate-limited network namespace). Every iteration runs each arm once, in an order that rotates
from iteration to iteration so slow drift of the machine hits every arm alike. Forward
(model + loss) and backward are timed separately, after a barrier, on every rank; the
reported time of an iteration is the slowest rank's. Arms:

* ``baseline``: unpatched Megatron-Core tensor parallelism.
* ``domino``: the same model with ``apply_domino`` for each Domino setting.
* ``oracle``: unpatched, every tensor-parallel collective a no-op.
* ``domino_noop``: Domino with no-op collectives (the cost of chunking alone).
After the timed rounds, with two or more settings, ``--domino-chunks auto``'s tuner
(:class:`~megatron_domino.autotune.AutoTuner`) picks one of them from its own short
measurement, so the report can check its choice against the arms' medians.

* ``comm_only``: the collectives one step of ``baseline``, of a Domino setting or of
  DeepSpeed performs, same sizes and order, with no compute
  (:mod:`lab.bench.comm_only`).
* ``deepspeed`` / ``deepspeed_noop`` (cases with ``"deepspeed": true``): DeepSpeed's own
  Domino block in place of the decoder, with its collectives real / no-ops
  (:mod:`lab.bench.deepspeed_arm`). Its per-token loss is checked against
  the baseline's before anything is timed. Such cases build every Megatron arm with SDPA core
  attention (``"sdpa": true``), DeepSpeed's kernel, so all arms do identical work.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from lab.bench.comm_only import CollectiveLog, replay, tp_collectives_logged
from lab.bench.deepspeed_arm import build_deepspeed_block, deepspeed_decoder
from lab.bench.emulated_link import (
    EmulatedLink,
    LinkModel,
    tp_collectives_emulated,
)
from lab.bench.metrics import DEEPSPEED, arm_names, comm_only_arm
from lab.bench.noop_collectives import tp_collectives_skipped
from lab.bench.sdpa_attention import sdpa_layer_spec
from lab.models.gpt_model import GPTOptions, build_gpt_model, causal_attention_mask
from megatron_domino.analysis.spans import collective_spans, summarize
from megatron_domino.apply import apply_domino
from megatron_domino.autotune import AutoTuner
from megatron_domino.base.config import DominoConfig
from megatron_domino.base.recorder import EventRecorder
from megatron_domino.runtime.cpu_runtime import runtime_for_device
from megatron_domino.runtime.distributed import destroy_distributed, init_distributed


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", required=True, help="JSON: model shape and Domino settings.")
    parser.add_argument("--iters", type=int, default=10, help="Measured iterations per arm.")
    parser.add_argument("--warmup", type=int, default=2, help="Unmeasured iterations per arm.")
    parser.add_argument("--out", required=True, help="Where rank 0 writes the JSON result.")
    return parser.parse_args(argv)


def _batch(options: GPTOptions, micro_batch_size: int, device) -> dict:
    generator = torch.Generator().manual_seed(0)
    s = options.seq_length
    tokens = torch.randint(0, options.vocab_size, (micro_batch_size, s), generator=generator)
    return {
        "input_ids": tokens.to(device),
        "position_ids": torch.arange(s).expand(micro_batch_size, s).to(device),
        "attention_mask": causal_attention_mask(s, device),
        "labels": torch.roll(tokens, -1, dims=1).to(device),
    }


#: The link's per-phase wait counters and the step parts they become.
_LINK_WAITS = {"blocked_s": "blocked", "peer_wait_s": "peer_wait"}


def _timed_step(
    model, batch, log: CollectiveLog | None = None, link: EmulatedLink | None = None
) -> dict[str, float]:
    """``fwd`` (forward + loss) and ``bwd`` wall seconds of one micro-batch, slowest rank's.

    ``log``, if given, is told which phase runs (for :func:`tp_collectives_logged`). With the
    emulated ``link``, also ``blocked_fwd`` / ``blocked_bwd``: the seconds the least-blocked
    rank spent blocked in waits on the link per phase once every rank had launched (the
    communication the schedule left exposed, measured without the noise of compute times),
    and ``peer_wait_fwd`` / ``peer_wait_bwd``: the most a rank waited for the other to launch
    (:class:`~lab.bench.emulated_link.LinkStats`).
    """
    cuda = torch.cuda.is_available()
    model.zero_grad(set_to_none=True)
    dist.barrier()
    parts, loss = {}, None
    for phase in ("fwd", "bwd"):
        if log is not None:
            log.phase = phase
        if link is not None:
            link.phase = phase
            before = {name: link.stats.as_dict()[name].get(phase, 0.0) for name in _LINK_WAITS}
        start = time.perf_counter()
        if loss is None:
            loss = model(**batch).float().mean()
        else:
            loss.backward()
        if cuda:
            torch.cuda.synchronize()
        parts[phase] = time.perf_counter() - start
        if link is not None:
            for name, part in _LINK_WAITS.items():
                after = link.stats.as_dict()[name].get(phase, 0.0)
                parts[f"{part}_{phase}"] = after - before[name]
    if link is not None:
        link.phase = ""
    # The slowest rank's times and peer waits; the least-blocked rank's blocked time: a rank
    # whose peer launched late waits for a wire that started late, which its own schedule
    # did not cause, while the late rank's waits are what the wire imposed.
    reduced = {}
    for op, names in ((dist.ReduceOp.MAX, [n for n in parts if not n.startswith("blocked")]),
                      (dist.ReduceOp.MIN, [n for n in parts if n.startswith("blocked")])):  # fmt: skip
        values = torch.tensor([parts[name] for name in names], dtype=torch.float64)
        dist.all_reduce(values, op=op)
        reduced |= dict(zip(names, values.tolist(), strict=True))
    return {name: reduced[name] for name in parts}


def _peak_memory_bytes(model, batch) -> int:
    """Peak memory of one forward+backward: the CUDA allocator's peak on GPU; on the CPU the
    bytes of distinct storages autograd saved for backward (the activations; the parameters'
    own storages left out, which a linear may save or keep beside its saved tensors), which is
    what chunking could change."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        _timed_step(model, batch)
        return torch.cuda.max_memory_allocated()
    parameters = {param.untyped_storage().data_ptr() for param in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        _timed_step(model, batch)
    return sum(storages.values())


#: DeepSpeed's block against Megatron's in fp32 (measured: 5e-7 with different attention
#: kernels, bit-identical with SDPA on both, tests/ranks/test_bench_deepspeed.py).
DEEPSPEED_RTOL = 1e-4


def _same_loss(model, batch, baseline, deepspeed) -> dict:
    """Per-token losses ``[b, s]`` of the baseline and of DeepSpeed's block on the same
    weights and batch; raises if they differ by more than :data:`DEEPSPEED_RTOL`, since a
    speed comparison of different functions would mean nothing."""
    losses = []
    for context in (baseline, deepspeed):
        with context(), torch.no_grad():
            losses.append(model(**batch).float())
    error = float((losses[1] - losses[0]).abs().max() / losses[0].abs().max())
    if error > DEEPSPEED_RTOL:
        raise RuntimeError(
            f"DeepSpeed's Domino block computes another function than the Megatron model: "
            f"per-token loss differs by {error:.2e} relative (> {DEEPSPEED_RTOL})."
        )
    return {"max_relative_loss_difference": error}


def _auto_choice(model, batch, candidates: list[DominoConfig]) -> dict:
    """What ``--domino-chunks auto`` picks among ``candidates``, timing micro-batch steps as
    the training loop times iterations (slowest rank's, so every rank picks the same)."""
    tuner = AutoTuner(candidates)
    while not tuner.done:
        with apply_domino(model, tuner.current):
            times = _timed_step(model, batch)
        tuner.record(times["fwd"] + times["bwd"])
    return tuner.record_dict()


def _comm_only_step(log: CollectiveLog, tp_group, cpu_samples: dict):
    """The comm-only arm of the step ``log`` recorded: its phases' collectives replayed; each
    replay's CPU seconds are appended to ``cpu_samples[phase]``."""
    calls = {phase: log.of_phase(phase) for phase in ("fwd", "bwd")}
    buffers = {phase: {} for phase in calls}

    def step() -> dict[str, float]:
        wall = {}
        for phase in ("fwd", "bwd"):
            wall[phase], cpu = replay(calls[phase], tp_group, buffers[phase])
            cpu_samples[phase].append(cpu)
        return wall

    return step


def _link_waits(model, batch, link: EmulatedLink) -> list[dict]:
    """One step on the emulated link, traced: per phase and launching code, how many
    collectives, their bytes and the milliseconds this rank was blocked waiting for them once
    both ranks had launched (``blocked_ms``) and before (``peer_wait_ms``). What the schedule
    leaves exposed, Megatron-Core's own collectives included."""
    link.trace = []
    _timed_step(model, batch, link=link)
    waits: dict[tuple, dict] = {}
    for event in link.trace:
        key = (event.phase, event.caller, event.kind, event.nbytes)
        entry = waits.setdefault(key, {"count": 0, "blocked_ms": 0.0, "peer_wait_ms": 0.0})
        peer_wait = max(0, min(event.wait_end_ns, event.last_launch_ns) - event.wait_begin_ns)
        entry["count"] += 1
        entry["peer_wait_ms"] += peer_wait / 1e6
        entry["blocked_ms"] += (event.wait_end_ns - event.wait_begin_ns - peer_wait) / 1e6
    link.trace = None
    return [
        {"phase": phase, "caller": caller, "kind": kind, "bytes": nbytes, **entry}
        for (phase, caller, kind, nbytes), entry in waits.items()
    ]


def _stats(samples: list[float]) -> dict:
    return {"median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples)}


def run_case(case: dict, iters: int, warmup: int) -> dict:
    """Time every arm of ``case`` and return their statistics and the overlap evidence.

    With ``case["link"]`` of kind ``emulated`` every arm's TP collectives run on the emulated
    interconnect (:mod:`lab.bench.emulated_link`) at its ``mbit`` rate, and
    the result carries the link's own statistics (``link_stats``: its CPU seconds against the
    wire seconds it modelled); otherwise they run on the process group's backend.
    """
    link = case.get("link", {})
    if link.get("kind") != "emulated":
        return _run_arms(case, iters, warmup, link=None)
    options = GPTOptions(**case["model"])
    # The comm-only arm launches a whole phase before waiting: room for 32 of the largest
    # tensors a rank contributes (an activation [s, b, h] in fp32) is more than any phase.
    activation = options.seq_length * case["micro_batch_size"] * options.hidden_size * 4
    model = LinkModel.from_mbit(link["mbit"], latency_s=link.get("latency_s", 50e-6))
    group = parallel_state.get_tensor_model_parallel_group()
    emulated = EmulatedLink(group, model, capacity_bytes=32 * activation)
    with tp_collectives_emulated(emulated):
        result = _run_arms(case, iters, warmup, link=emulated)
    return {**result, "link_stats": emulated.stats.as_dict()}


def _build_model(case: dict, options: GPTOptions) -> torch.nn.Module:
    """The case's model: a ``GPTModel`` (with SDPA attention for the DeepSpeed arm), or with
    ``pattern`` Megatron-Core's ``HybridModel`` of it (:mod:`lab.models.hybrid_model`)."""
    if case.get("pattern"):
        from lab.models.hybrid_model import build_hybrid_model

        return build_hybrid_model(options, case["pattern"])
    return build_gpt_model(options, spec=sdpa_layer_spec(options) if case.get("sdpa") else None)


def _run_arms(case: dict, iters: int, warmup: int, link: EmulatedLink | None) -> dict:
    options = GPTOptions(**case["model"])
    micro_batch_size = case["micro_batch_size"]
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    model = _build_model(case, options)
    batch = _batch(options, micro_batch_size, device)
    tp_group = model.decoder.tp_group
    settings = {name: DominoConfig(**kw) for name, kw in case["domino"].items()}
    deepspeed_block = build_deepspeed_block(model) if case.get("deepspeed") else None

    def arm(domino=None, skip_collectives=False, recorder=None, deepspeed=False):
        @contextlib.contextmanager
        def context():
            with contextlib.ExitStack() as stack:
                if skip_collectives:
                    stack.enter_context(tp_collectives_skipped(tp_group))
                if domino is not None:
                    kwargs = {"recorder": recorder} if recorder is not None else {}
                    stack.enter_context(apply_domino(model, domino, **kwargs))
                if deepspeed:
                    stack.enter_context(deepspeed_decoder(model, deepspeed_block))
                yield

        return context

    # A row of the report: a Domino setting, or DeepSpeed's block; each has a real and a
    # no-op arm, named by metrics.arm_names.
    rows = {name: {"domino": config} for name, config in settings.items()}
    if deepspeed_block is not None:
        rows[DEEPSPEED] = {"deepspeed": True}
    arms = {"baseline": arm(), "oracle": arm(skip_collectives=True)}
    for name, kind in rows.items():
        real, noop, _ = arm_names(name)
        arms[real] = arm(**kind)
        arms[noop] = arm(skip_collectives=True, **kind)
    deepspeed_check = None
    if deepspeed_block is not None:
        deepspeed_check = _same_loss(model, batch, arms["baseline"], arms[arm_names(DEEPSPEED)[0]])

    def step_of(name: str):
        def step() -> dict[str, float]:
            with arms[name]():
                return _timed_step(model, batch, link=link)

        return step

    steps = {name: step_of(name) for name in arms}
    collectives, comm_cpu = {}, {}
    logged = {"baseline": "baseline", **{name: arm_names(name)[0] for name in rows}}
    for name, arm_name in logged.items():
        log = CollectiveLog()
        with arms[arm_name]():
            with tp_collectives_logged(tp_group, log):
                _timed_step(model, batch, log)
        collectives[name] = {
            phase: {"count": len(log.of_phase(phase)), "bytes": log.bytes_of_phase(phase)}
            for phase in ("fwd", "bwd")
        }
        comm_cpu[name] = {"fwd": [], "bwd": []}
        steps[comm_only_arm(name)] = _comm_only_step(log, tp_group, comm_cpu[name])

    samples = {name: collections.defaultdict(list) for name in steps}
    names = list(steps)
    rank0 = dist.get_rank() == 0
    for iteration in range(warmup + iters):
        if rank0:
            print(
                f"  iteration {iteration + 1}/{warmup + iters} ({len(names)} arms)"
                f"{' [warm-up]' if iteration < warmup else ''}",
                flush=True,
            )
        shift = iteration % len(names)
        for name in names[shift:] + names[:shift]:
            times = steps[name]()
            if iteration >= warmup:
                for part, seconds in times.items():
                    samples[name][part].append(seconds)
                samples[name]["total"].append(times["fwd"] + times["bwd"])

    auto = _auto_choice(model, batch, list(settings.values())) if len(settings) > 1 else None

    overlap, timelines = {}, {}
    for name, config in settings.items():
        recorder = EventRecorder()
        with arm(domino=config, recorder=recorder)():
            _timed_step(model, batch)
        events = recorder.events()
        spans = collective_spans(events)
        overlap[name] = {
            direction: asdict(summarize(spans, direction)) for direction in ("fwd", "bwd")
        }
        timelines[name] = [asdict(event) for event in events]
    link_waits = {}
    if link is not None:
        for name in ["baseline"] + [arm_names(name)[0] for name in rows]:
            with arms[name]():
                link_waits[name] = _link_waits(model, batch, link)
    memory_arms = ["baseline"] + [arm_names(name)[0] for name in rows]
    peak_memory = {}
    for name in memory_arms:
        with arms[name]():
            peak_memory[name] = _peak_memory_bytes(model, batch)
    return {
        "arms": {
            name: {part: _stats(v) for part, v in parts.items()} for name, parts in samples.items()
        },
        "samples": {name: dict(parts) for name, parts in samples.items()},
        "collectives": collectives,
        "comm_only_cpu_s": {
            name: {phase: statistics.median(v[warmup:]) for phase, v in phases.items()}
            for name, phases in comm_cpu.items()
        },
        "auto": auto,
        "deepspeed_check": deepspeed_check,
        "recorder_overlap": overlap,
        "timelines": timelines,
        "link_waits": link_waits,
        "peak_memory_bytes": peak_memory,
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    case = json.loads(args.case)
    torch.set_num_threads(case.get("threads_per_rank", 1))
    with runtime_for_device():
        init_distributed(case["tensor_model_parallel_size"], seed=1234)
        try:
            result = run_case(case, args.iters, args.warmup)
            if dist.get_rank() == 0:
                with open(args.out, "w") as out:
                    json.dump({"case": case, **result}, out, indent=1)
        finally:
            destroy_distributed()


if __name__ == "__main__":
    main()
