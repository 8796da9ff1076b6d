"""A Domino step is CUDA-graph safe as far as a CPU can tell (:mod:`lab.analysis.capture_safety`).

Two gloo ranks (TP = 2), the Llama-style tiny GPT. For each setting, after one warm-up
forward and backward (which builds the caches a capture would find built: rotary tables,
the sequence split's causal rows), two more are traced with :class:`StepTrace`; each must

* make no host-synchronising op (``.item()``, ``bool(t)``, ``nonzero``, ``torch.tensor``
  from host data, ...) anywhere in the model's forward and backward, Domino's schedule,
  collectives and Megatron-Core's own modules included;
* dispatch the very same ops (names, shapes, dtypes), collectives included, on both
  iterations;
* read every tensor the step did not create (parameters, the batch, caches) at the same
  address on both iterations.

The checks must be able to fail: on the same ranks the schedule is then broken on purpose
three ways (a Python branch on a tensor's value in an op, i.e. an ``.item()``; an extra op
every third call; a buffer made anew before every step and read in it), and each must be
reported by the check it targets. One launch of two ranks, about 50 s on two busy cores.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from multiproc import run_on_ranks
from tiny_models import LLAMA_STYLE

from lab.analysis.capture_safety import StepTrace, first_difference
from lab.analysis.equivalence import forward_backward, token_batch
from lab.models.gpt_model import GPTOptions, build_gpt_model
from megatron_domino.apply import apply_domino
from megatron_domino.base.settings import setting
from megatron_domino.engine.schedule import LayerOps

SETTINGS = ("p2", "p2-k2", "p2-no-backward-overlap", "s2", "sp-p2", "sp-s2")
MICRO_BATCH = 2


def _traced_steps(model, batch, count: int = 2) -> list[StepTrace]:
    forward_backward(model, batch)  # warm-up, as a capture is preceded by eager steps
    traces = []
    for _ in range(count):
        with StepTrace() as trace:
            forward_backward(model, batch)
        traces.append(trace)
    return traces


def _verdict(traces: list[StepTrace]) -> dict:
    first, second = traces
    return {
        "hazards": [(h.op, h.where) for t in traces for h in t.hazards],
        "ops": first_difference(first.ops, second.ops),
        "addresses": first_difference(first.external_reads, second.external_reads),
        "collectives": len(first.collectives),
        "op_count": len(first.ops),
    }


def _item_in_mlp_norm(original):
    def mlp_norm(self, chunk):
        original(self, chunk)
        if chunk.hidden.sum().item() > 0:  # the host waits for a device value
            pass

    return mlp_norm


def _extra_op_every_third_call(original):
    calls = [0]

    def mlp_norm(self, chunk):
        original(self, chunk)
        calls[0] += 1
        if calls[0] % 3 == 0:  # 4 calls a step (2 layers x 2 chunks): once, then twice
            chunk.residual = chunk.residual * 1.0

    return mlp_norm


def _broken_runs(model, batch) -> dict:
    """The three injected faults, each traced as a Domino step."""
    results = {}
    for name, wrap in (("item", _item_in_mlp_norm), ("extra-op", _extra_op_every_third_call)):
        original = LayerOps.mlp_norm
        LayerOps.mlp_norm = wrap(original)
        try:
            with apply_domino(model, setting("p2").config):
                results[name] = _verdict(_traced_steps(model, batch))
        finally:
            LayerOps.mlp_norm = original
    # A buffer made anew before every step and read inside it: a replay would read the old one.
    original = LayerOps.attention_norm
    fresh = {}

    def attention_norm(self, chunk):
        original(self, chunk)
        chunk.residual = chunk.residual + fresh["buffer"]

    LayerOps.attention_norm = attention_norm
    try:
        with apply_domino(model, setting("p2").config):
            fresh["buffer"] = torch.zeros(())
            forward_backward(model, batch)
            traces = []
            for _ in range(2):
                fresh["buffer"] = torch.zeros(())
                with StepTrace() as trace:
                    forward_backward(model, batch)
                traces.append(trace)
        results["fresh-buffer"] = _verdict(traces)
    finally:
        LayerOps.attention_norm = original
    return results


def _check_settings(names: tuple[str, ...]) -> dict:
    options = GPTOptions(num_layers=2, **LLAMA_STYLE)
    models = {
        sequence_parallel: build_gpt_model(
            dataclasses.replace(options, sequence_parallel=sequence_parallel)
        )
        for sequence_parallel in (False, True)
    }
    batch = token_batch(options, MICRO_BATCH)
    results = {}
    for name in names:
        chosen = setting(name)
        model = models[chosen.sequence_parallel]
        with apply_domino(model, chosen.config):
            results[name] = _verdict(_traced_steps(model, batch))
    results["stock"] = _verdict(_traced_steps(models[False], batch))
    results["broken"] = _broken_runs(models[False], batch)
    return results


@functools.cache
def _results() -> list[dict]:
    return run_on_ranks(_check_settings, 2, args=(SETTINGS,))


@pytest.mark.parametrize("name", SETTINGS)
def test_a_domino_step_has_no_host_sync_and_repeats_its_ops_and_addresses(name):
    for rank in _results():
        verdict = rank[name]
        assert verdict["hazards"] == [], verdict["hazards"]
        assert verdict["ops"] is None, verdict["ops"]
        assert verdict["addresses"] is None, verdict["addresses"]
        # Domino's own collectives were seen: more than stock's two per layer and direction.
        assert verdict["collectives"] > rank["stock"]["collectives"] > 0


def test_the_checks_catch_an_item_a_changing_schedule_and_a_fresh_buffer():
    for rank in _results():
        broken = rank["broken"]
        ops = {op for op, _ in broken["item"]["hazards"]}
        assert ops == {"aten._local_scalar_dense.default"}, broken["item"]["hazards"]
        assert all("test_capture_safety.py" in where for _, where in broken["item"]["hazards"])
        assert broken["item"]["ops"] is None
        assert broken["extra-op"]["hazards"] == [] and broken["extra-op"]["ops"] is not None
        assert broken["fresh-buffer"]["hazards"] == [] and broken["fresh-buffer"]["ops"] is None
        assert broken["fresh-buffer"]["addresses"] is not None
