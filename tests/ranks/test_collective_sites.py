"""Every collective Domino issues is a row of the one table,
:data:`megatron_domino.communication.collectives.COLLECTIVE_SITES`, launched and waited where the row says.

On TP = 2, one recorded forward and backward at ``p = 2`` of the tiny GPT, whose embedding and
output layer Domino takes over (the model's two ends: ``embedding_ar``, ``head_dgrad_ar``),
and one of the same model with ``--sequence-parallel`` (the all-gathers, reduce-scatters, their
backward twins and the re-gathers). The recorder also keeps, for every launch and wait, the
library's call stack (``module:function``, outermost first) and, for every launch, the
``torch.distributed`` collectives the library called for it. Then:

* the ``(label, direction)`` pairs recorded are exactly the table's: every recorded collective
  has a row, and every row was recorded by one of the two steps;
* every launch's stack holds its row's ``launched_in`` path, in order, and every wait's its
  ``waited_in``;
* every launch called its row's kind of collective, and only that.

And one forward and backward at ``p = 2`` on Transformer Engine's layers (TE's Python on the CPU
backend) under FP8 current scaling (``tensorwise``) and SP, the H100 path, with every
``torch.distributed`` collective noted where Domino's code is on the stack, TE's own included:
each is one of the table's rows by its kind and its row's launch path, on the TP group or, for
the blocking amax reductions of Domino's chunked casts (rows not in flight), on the amax group,
and both of those rows occur.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
from multiproc import run_on_ranks
from te_models import te_options, te_spec
from tiny_models import TINY

from lab.analysis.equivalence import forward_backward, token_batch
from lab.models.gpt_model import GPTOptions, build_gpt_model
from megatron_domino.apply import apply_domino
from megatron_domino.base.recorder import LAUNCH, WAIT_BEGIN, EventRecorder
from megatron_domino.base.settings import setting
from megatron_domino.communication.collectives import COLLECTIVE_SITES, collective_site
from megatron_domino.runtime.tp_collectives import COLLECTIVE_KINDS, swapped_tp_collectives

GPT = GPTOptions(num_layers=2, **TINY, num_attention_heads=4)
#: The traced steps (settings of :mod:`megatron_domino.base.settings`).
TRACED = ("p2", "sp-p2")
_LIBRARY = "megatron_domino."
_CPU_RUNTIME = "runtime.cpu_runtime:"


def _library_stack(frame) -> tuple[str, ...]:
    """The library's frames from ``frame`` out, as ``module:function``, outermost first."""
    stack = []
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith(_LIBRARY):
            stack.append(f"{module.removeprefix(_LIBRARY)}:{frame.f_code.co_qualname}")
        frame = frame.f_back
    return tuple(reversed(stack))


class _TracingRecorder(EventRecorder):
    """An :class:`EventRecorder` that also keeps, per ``(event, label, direction)``, the
    distinct ``(call stack, collectives called)`` of its launches and waits."""

    def __init__(self) -> None:
        super().__init__(use_cuda_events=False)
        self.called: list[str] = []  # by the library since the last launch
        self.seen: dict[tuple[str, str, str], set] = {}

    def record(self, kind, name, layer, chunk, direction, piece=0, collective=None) -> None:
        super().record(kind, name, layer, chunk, direction, piece, collective)
        if kind not in (LAUNCH, WAIT_BEGIN):
            return
        called = ()
        if kind == LAUNCH:
            called, self.called = tuple(sorted(set(self.called))), []
        entry = (_library_stack(sys._getframe(1)), called)
        self.seen.setdefault((kind, name, direction), set()).add(entry)

    def noting(self, name: str, original):
        """``original`` (a TP collective), noting its kind when the library calls it."""
        kind = COLLECTIVE_KINDS[name]

        def collective(*args, **kwargs):
            if sys._getframe(1).f_globals.get("__name__", "").startswith(_LIBRARY):
                self.called.append(kind)
            return original(*args, **kwargs)

        return collective


def _trace() -> dict:
    """On every rank: per traced step, what :class:`_TracingRecorder` saw."""
    seen = {}
    for name in TRACED:
        named = setting(name)
        options = dataclasses.replace(GPT, sequence_parallel=named.sequence_parallel)
        model = build_gpt_model(options)
        batch = token_batch(options, 4)
        recorder = _TracingRecorder()
        with swapped_tp_collectives(recorder.noting):
            with apply_domino(model, named.config, recorder=recorder):
                model(**batch).mean().backward()
        seen[name] = recorder.seen
    return seen


@pytest.fixture(scope="module")
def traced() -> dict:
    return run_on_ranks(_trace, 2)[0]


def test_the_labels_recorded_are_the_tables_rows(traced):
    recorded = {
        (event, label, direction) for seen in traced.values() for event, label, direction in seen
    }
    keys = {(site.label, site.direction) for site in COLLECTIVE_SITES}
    assert len(keys) == len(COLLECTIVE_SITES), "two rows for one label and direction"
    rows = {(site.label, site.direction) for site in COLLECTIVE_SITES if site.in_flight}
    for event in (LAUNCH, WAIT_BEGIN):
        found = {(label, direction) for kind, label, direction in recorded if kind == event}
        assert found - rows == set(), f"{event}: recorded, no row"
        assert rows - found == set(), f"{event}: a row no traced step recorded"


def _in_order(path: tuple[str, ...], stack: tuple[str, ...]) -> bool:
    frames = iter(stack)
    return all(step in frames for step in path)


def test_each_collective_is_launched_and_waited_where_its_row_says(traced):
    wrong = []
    for name, seen in traced.items():
        for (event, label, direction), entries in sorted(seen.items()):
            site = collective_site(label, direction)
            path = site.launched_in if event == LAUNCH else site.waited_in
            wrong += [
                (name, event, label, direction, stack)
                for stack, _ in entries
                if not _in_order(path, stack)
            ]
    assert not wrong, wrong[:2]


def test_each_launch_calls_its_rows_kind_of_collective(traced):
    for name, seen in traced.items():
        for (event, label, direction), entries in seen.items():
            if event == LAUNCH:
                kinds = {called for _, called in entries}
                assert kinds == {(collective_site(label, direction).kind,)}, (
                    name,
                    label,
                    direction,
                    kinds,
                )


def _te_fp8_collectives() -> list[tuple[str, str, tuple[str, ...]]]:
    """On every rank: ``(kind, group, library stack)`` of every collective called with
    Domino's code on the stack in one p = 2 step on TE's layers, FP8 tensorwise + SP; the group
    is ``tp``, ``amax`` (the runtime's amax group) or ``other``."""
    import torch.distributed as dist

    options = te_options(True, bf16=True, fp8_format="hybrid", fp8_recipe="tensorwise")
    model = build_gpt_model(options, spec=te_spec(True))
    batch = token_batch(options, 4)
    forward_backward(model, batch)  # TE makes its FP8 state in the first FP8 step
    groups, noted = {}, []

    def noting(name, original):
        def collective(*args, **kwargs):
            # Domino's code, not the CPU runtime's device mode (on every call's stack here).
            stack = tuple(
                f for f in _library_stack(sys._getframe(1)) if not f.startswith(_CPU_RUNTIME)
            )
            if stack and groups:
                group = kwargs.get("group")
                if group is None:  # by position, after the tensors (torch.distributed's order)
                    group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
                which = next((k for k, g in groups.items() if g is group), "other")
                noted.append((COLLECTIVE_KINDS[name], which, stack))
            return original(*args, **kwargs)

        return collective

    with swapped_tp_collectives(noting):
        with apply_domino(model, setting("sp-p2").config) as handle:
            groups.update(tp=handle.runtime.tp_group, amax=handle.runtime.amax_group)
            forward_backward(model, batch)
            groups.clear()
    return noted


@pytest.mark.te
def test_a_te_fp8_step_issues_only_the_tables_collectives():
    noted = run_on_ranks(_te_fp8_collectives, 2, te=True)[0]
    assert noted
    unlisted, rows_seen = [], set()
    for kind, group, stack in noted:
        rows = [
            site
            for site in COLLECTIVE_SITES
            if site.kind == kind and _in_order(site.launched_in, stack)
        ]
        if not rows:
            unlisted.append((kind, group, stack))
            continue
        site = max(rows, key=lambda row: len(row.launched_in))  # the most specific path
        rows_seen.add((site.label, site.direction))
        assert group == ("tp" if site.in_flight else "amax"), (site.label, group, stack)
    assert not unlisted, "\n".join(f"{k} on {g}: {' > '.join(s)}" for k, g, s in unlisted[:3])
    blocking = {(s.label, s.direction) for s in COLLECTIVE_SITES if not s.in_flight}
    assert blocking <= rows_seen, rows_seen
