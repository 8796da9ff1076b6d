"""``--domino-report``: the report's text and totals from synthetic spans, its flags, and the
report printed by a real TP = 2 training run."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import torch
from launch import TINY_GPT, run_pretrain
from megatron.training import arguments as megatron_arguments

from megatron_domino.analysis.report import (
    headline,
    layer_rows,
    not_hidden,
    passes,
    report_lines,
    report_totals,
    warning_lines,
)
from megatron_domino.analysis.spans import CollectiveSpan
from megatron_domino.base.recorder import NULL_RECORDER, EventRecorder
from megatron_domino.training import pretrain as entry
from megatron_domino.training.domino_report import DominoOverlapReport
from megatron_domino.training.runs import read_records

OVERLAPPED = (("attention_core", 0, 1, 0),)


def span(
    name,
    layer,
    chunk,
    direction,
    launch,
    wait_begin,
    wait_end,
    *,
    overlapped=True,
    piece=0,
    order=0,
):
    return CollectiveSpan(
        name=name, layer=layer, chunk=chunk, piece=piece, direction=direction, launch_s=launch,
        wait_begin_s=wait_begin, wait_end_s=wait_end,
        overlapped_by=OVERLAPPED if overlapped else (), order=order,
    )  # fmt: skip


def one_step(*, hide_all: bool = True) -> list[CollectiveSpan]:
    """Two layers, two chunks, forward then backward, times in seconds.

    Forward: every collective flies 4 ms; the last (layer 1 mlp_ar chunk 1) overlaps nothing.
    Backward: layer 0's attention_dgrad_ar of chunk 1 finishes last and overlaps nothing.
    With ``hide_all=False`` layer 1 fwd mlp_ar chunk 0 also overlaps nothing.
    """
    t = 0.0
    spans = []
    for layer in (0, 1):
        for name in ("attention_ar", "mlp_ar"):
            for chunk in (0, 1):
                last = layer == 1 and name == "mlp_ar" and chunk == 1
                lonely = last or (not hide_all and layer == 1 and name == "mlp_ar" and chunk == 0)
                spans.append(
                    span(name, layer, chunk, "fwd", t, t + 0.003, t + 0.004, overlapped=not lonely)
                )
                t += 0.005
    for layer in (1, 0):
        for name in ("mlp_dgrad_ar", "attention_dgrad_ar"):
            for chunk in (0, 1):
                last = layer == 0 and name == "attention_dgrad_ar" and chunk == 1
                spans.append(
                    span(name, layer, chunk, "bwd", t, t + 0.001, t + 0.002, overlapped=not last)
                )
                t += 0.005
    return spans


def test_layer_rows_and_totals_add_up():
    spans = one_step()
    rows = layer_rows(spans)
    assert [(r.layer, r.direction, r.collectives) for r in rows] == [
        ("0", "fwd", 4),
        ("0", "bwd", 4),
        ("1", "fwd", 4),
        ("1", "bwd", 4),
    ]
    assert rows[0].in_flight_s == pytest.approx(0.016)
    assert rows[0].exposed_s == pytest.approx(0.004)
    assert rows[0].overlap_share == pytest.approx(0.75)
    assert rows[1].overlap_share == pytest.approx(0.5)
    totals = report_totals(spans)
    assert totals["collectives"] == 16 and totals["passes"] == 2
    assert totals["fwd"]["overlap_share"] == pytest.approx(0.75)
    assert totals["bwd"]["overlap_share"] == pytest.approx(0.5)
    # in flight: fwd 8 x 4 ms, bwd 8 x 2 ms; exposed: 8 x 1 ms each way.
    assert totals["overlap_share"] == pytest.approx(1 - 0.016 / 0.048)
    assert totals["overlapped"] == 14 and totals["not_hidden"] == 0
    json.dumps(totals)  # goes to --log-json as it is
    assert headline(totals) == (
        "66.7% of the in-flight time of 16 collectives overlapped compute (fwd 75.0%, bwd 50.0%)"
    )


def test_the_last_collective_of_each_pass_is_not_warned_about():
    spans = one_step()
    assert not_hidden(spans) == [] and warning_lines(spans) == []
    text = "\n".join(report_lines(spans, iteration=7, clock="wall clock", rank=0))
    assert "WARNING" not in text
    assert "by design: layer 1 fwd mlp_ar chunk 1, layer 0 bwd attention_dgrad_ar chunk 1" in text


def test_a_collective_that_hid_nothing_gets_a_loud_line_of_its_own():
    spans = one_step(hide_all=False)
    assert warning_lines(spans) == [
        "WARNING: layer 1 fwd mlp_ar chunk 0 hid nothing "
        "(no other chunk's compute ran while it flew)"
    ]
    lines = report_lines(spans, iteration=7, clock="wall clock", rank=0)
    assert lines[-1].startswith("WARNING: layer 1 fwd mlp_ar chunk 0")
    assert report_totals(spans)["not_hidden"] == 1


def test_each_micro_batch_is_a_pass_with_its_own_exempt_last_collective():
    """Two micro-batches: fwd, bwd, fwd, bwd; each pass's last collective is exempt, and a
    collective that hid nothing in both forward passes is reported once, with the count."""
    first, second = one_step(hide_all=False), one_step(hide_all=False)
    shift = first[-1].wait_end_s + 0.01
    second = [span(s.name, s.layer, s.chunk, s.direction, s.launch_s + shift,
                   s.wait_begin_s + shift, s.wait_end_s + shift, overlapped=bool(s.overlapped_by))
              for s in second]  # fmt: skip
    spans = first + second
    assert [run[0].direction for run in passes(spans)] == ["fwd", "bwd", "fwd", "bwd"]
    assert warning_lines(spans) == [
        "WARNING: layer 1 fwd mlp_ar chunk 0 hid nothing "
        "(no other chunk's compute ran while it flew) in 2 of 2 forward passes"
    ]
    assert report_totals(spans)["not_hidden"] == 2


def test_column_pieces_are_named_in_warnings():
    spans = [
        span("mlp_ar", 0, 0, "fwd", 0.0, 0.001, 0.002, piece=0, overlapped=False),
        span("mlp_ar", 0, 0, "fwd", 0.003, 0.004, 0.005, piece=1, overlapped=False),
    ]
    assert warning_lines(spans) == [
        "WARNING: layer 0 fwd mlp_ar chunk 0 piece 0 hid nothing "
        "(no other chunk's or piece's compute ran while it flew)"
    ]


def test_forward_only_recording_says_why_backward_is_missing():
    spans = [s for s in one_step() if s.direction == "fwd"]
    text = "\n".join(report_lines(spans, iteration=2, clock="CUDA events", rank=0))
    assert "(CUDA events, rank 0)" in text and "no backward collectives recorded" in text
    assert headline(report_totals(spans)).endswith("(fwd 75.0%)")
    assert report_lines([], iteration=2, clock="wall clock", rank=0) == [
        "[domino-report] iteration 2 (wall clock, rank 0): no Domino collectives were recorded"
    ]


def reported(first: int, train_iters: int, count: int, monkeypatch) -> list[int]:
    """The iterations a report of ``count`` records in a run from ``first`` to ``train_iters``."""
    report = DominoOverlapReport(lambda: [], count, lambda: train_iters)
    return [i for i in range(first, train_iters + 1) if report._reported(i)]


def test_reported_iterations_skip_the_warm_up(monkeypatch):
    assert reported(1, 100, 3, monkeypatch) == [2, 3, 4]
    assert reported(11, 12, 3, monkeypatch) == [12]  # resumed at 10, two iterations left
    assert reported(1, 1, 3, monkeypatch) == [1]  # a one-iteration run reports that one


def test_the_recorder_is_attached_only_for_reported_steps(monkeypatch, capsys):
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 1)
    chunks = [SimpleNamespace(recorder=NULL_RECORDER), SimpleNamespace(recorder=NULL_RECORDER)]
    report = DominoOverlapReport(lambda: chunks, 2, lambda: 4)
    seen, written = {}, []
    for iteration in (1, 2, 3, 4):
        with report.reporting(iteration, written.append):
            seen[iteration] = [chunk.recorder for chunk in chunks]
        assert all(chunk.recorder is NULL_RECORDER for chunk in chunks)
    assert seen[1] == seen[4] == [NULL_RECORDER] * 2
    assert isinstance(seen[2][0], EventRecorder) and seen[2][0] is seen[2][1]  # one per step
    assert seen[2][0] is not seen[3][0]
    assert [(r["kind"], r["iteration"]) for r in written] == [
        ("domino_report", 2),
        ("domino_report", 3),
    ]
    assert "[domino-report] iteration 3 (wall clock, rank 0): " in capsys.readouterr().out
    with pytest.raises(RuntimeError), report.reporting(2, written.append):
        raise RuntimeError("a failed step")
    assert all(chunk.recorder is NULL_RECORDER for chunk in chunks)
    assert len(written) == 2  # a failed step is not reported


BASE = (
    f"{' '.join(TINY_GPT)} --tensor-model-parallel-size 2 --lr 1e-3 --train-iters 4 "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 100"
).split()


@pytest.mark.parametrize(("flags", "message"), [
    (["--domino-report"], "--domino-report reports Domino's overlap; add --domino."),
    (["--domino", "--domino-report", "--domino-report-iters", "0"], "must be >= 1, got 0"),
])  # fmt: skip
def test_report_flags_are_checked_after_megatron_parses_them(flags, message, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt_domino.py", *BASE, *flags])
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    args = megatron_arguments.parse_args(extra_args_provider=entry.add_flags)
    with pytest.raises(entry.StartupError, match=message):
        entry._script_checks(args)


@pytest.mark.slow
def test_tp2_training_prints_the_report_and_logs_its_totals(tmp_path):
    log_json = tmp_path / "log.jsonl"
    output = run_pretrain(
        [*BASE, "--data-cache-path", str(tmp_path / "cache"), "--log-json", str(log_json),
         "--domino", "--domino-report", "--domino-report-iters", "2"],
        cwd=tmp_path,
    )  # fmt: skip
    for iteration in (2, 3):
        # Printed by the last rank, which also writes --log-json.
        assert f"[domino-report] iteration {iteration} (wall clock, rank 1): " in output
    assert "[domino-report] iteration 1 " not in output
    assert "[domino-report] iteration 4 " not in output
    for layer in (0, 1):
        for direction in ("fwd", "bwd"):
            assert f"      {layer}  {direction}            8  " in output  # 2 chunks x 2 AR x 2 mb
    # The model's ends, per chunk: the embedding's all-reduce, the output layer's in backward.
    assert "    emb  fwd            4  " in output and "   head  bwd            4  " in output
    assert "  total  all           40  " in output
    assert "\nWARNING: layer " not in output, output
    reports = read_records(log_json, "domino_report")
    assert [r["iteration"] for r in reports] == [2, 3]
    for report in reports:
        assert report["collectives"] == 40 and report["passes"] == 4
        # Not overlapped, by design: each backward pass's last, and each end's first waited
        # (2 micro-batches x 3); each forward pass's last flies behind chunk 0's logits.
        assert report["overlapped"] == 34 and report["not_hidden"] == 0
        assert 0 <= report["exposed_s"] <= report["in_flight_s"]
