"""Part 6: a Domino training step captured in one CUDA graph and replayed, against eager.

What ``--cuda-graph-impl full_iteration`` is refused for until this passes on a GPU: the whole
forward and backward of a Domino step recorded by ``torch.cuda.graph`` and replayed must give
what the eager step gives. Two TP ranks share the GPU over gloo, whose collectives are CPU
work that no CUDA graph can hold, so the TP collectives are no-ops here
(:func:`lab.bench.noop_collectives.tp_collectives_skipped`: wrong numbers,
the same in both runs); what is checked is Domino's schedule of kernels under capture. Each
setting, on the Llama-style tiny GPT in fp32:

1. three eager steps on a side stream (capture needs warmed-up autograd and caches);
2. one eager step traced with :class:`~lab.analysis.capture_safety.StepTrace`
   on CUDA, where a device-to-host copy is visible too: no hazard allowed;
3. the same step captured (gradients in static ``.grad`` buffers, zeroed inside the graph),
   replayed twice: the loss and every gradient must equal the eager step's bit for bit (the
   same kernels on the same inputs, deterministic algorithms on), and the two replays each
   other.

On ``--device cpu`` there is nothing to capture: the part reports ``needs CUDA`` (skipped),
and the CPU side of the proof is ``tests/ranks/test_capture_safety.py``.
"""

from __future__ import annotations

import time

from lab.gpu_check import markdown
from lab.gpu_check.results import Part, PartResult

__all__ = ["SETTINGS", "capture_rank", "run_part"]

PART = Part(
    "capture",
    "6. CUDA graph capture of a Domino step (no-op collectives)",
    "lab.gpu_check.check_capture:capture_rank",
    failure_summary="a rank failed (a capture error is the answer: see the reason);",
)
SETTINGS = ("p2", "sp-s2")
NEEDS_CUDA = (
    "needs CUDA: a CUDA graph capture and replay of a Domino step (on the CPU, "
    "tests/ranks/test_capture_safety.py checks what can be checked without one)"
)
_WARMUP_STEPS = 3
_MICRO_BATCH = 2


def _step(model, batch) -> None:
    """Forward and backward into the parameters' existing ``.grad`` buffers."""
    for param in model.parameters():
        param.grad.zero_()
    model(**batch).float().mean().backward()


def _snapshot(model, loss) -> dict:
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return {"loss": loss.detach().clone(), **grads}


def _max_difference(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _capture_setting(name: str) -> dict:
    import torch
    from megatron.core import parallel_state

    from lab.analysis.capture_safety import StepTrace
    from lab.analysis.equivalence import token_batch
    from lab.bench.noop_collectives import tp_collectives_skipped
    from lab.models.gpu_check_models import build_on_device, model_options
    from megatron_domino.apply import apply_domino
    from megatron_domino.base.settings import setting

    chosen = setting(name)
    options = model_options(
        "llama", quick=True, bf16=False, sequence_parallel=chosen.sequence_parallel
    )
    model = build_on_device(options, "cuda")
    batch = token_batch(options, _MICRO_BATCH, device="cuda")
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    with tp_collectives_skipped(tp_group), apply_domino(model, chosen.config):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(_WARMUP_STEPS):
                _step(model, batch)
        torch.cuda.current_stream().wait_stream(side)
        with StepTrace(device_type="cuda") as trace:
            loss = model(**batch).float().mean()
            for param in model.parameters():
                param.grad.zero_()
            loss.backward()
        eager = _snapshot(model, loss)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for param in model.parameters():
                param.grad.zero_()
            static_loss = model(**batch).float().mean()
            static_loss.backward()
        replays = []
        for _ in range(2):
            graph.replay()
            torch.cuda.synchronize()
            replays.append(_snapshot(model, static_loss))
    return {
        "setting": name,
        "hazards": [f"{h.op}: {h.reason} ({h.where})" for h in trace.hazards],
        "replay_vs_eager": _max_difference(replays[0], eager),
        "replay_vs_replay": _max_difference(replays[1], replays[0]),
        "tensors": len(eager),
    }


def capture_rank(names: tuple[str, ...]) -> list[dict]:
    """Entry point for :func:`~lab.launch.ranks.run_ranks` (TP = 2 on one GPU):
    per setting ``{setting, hazards, replay_vs_eager, replay_vs_replay, tensors}``."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from lab.models.gpu_check_models import configure_cuda_numerics

    configure_cuda_numerics()
    # Megatron's RNG tracker sets the CUDA generator's state in every fork() (attention
    # dropout); only its graph-safe states may be set inside a capture.
    model_parallel_cuda_manual_seed(1234, use_cudagraphable_rng=True, force_reset_rng=True)
    return [_capture_setting(name) for name in names]


def _passed(row: dict) -> bool:
    return not row["hazards"] and row["replay_vs_eager"] == 0.0 and row["replay_vs_replay"] == 0.0


def _table(rows: list[list[dict]]) -> str:
    header = ("rank", "setting", "host hazards", "replay vs eager", "replay vs replay", "result")
    return markdown.table(
        header,
        (
            (rank, r["setting"], len(r["hazards"]), f"{r['replay_vs_eager']:.3g}",
             f"{r['replay_vs_replay']:.3g}", "passed" if _passed(r) else "FAILED")
            for rank, rows_of_rank in enumerate(rows)
            for r in rows_of_rank
        ),
    )  # fmt: skip


def run_part(device: str, quick: bool, budget_s: float) -> PartResult:
    """The part, as the check's parent runs it (two ranks on the GPU within ``budget_s``)."""
    del quick  # two tiny settings either way
    from lab.gpu_check.parts import run_part_ranks

    if device != "cuda":
        return PART.skipped(NEEDS_CUDA, budget_s)
    start = time.monotonic()
    per_rank, failed_part = run_part_ranks(PART, budget_s=budget_s, device=device, args=(SETTINGS,))
    if failed_part is not None:
        return failed_part
    failed = [
        f"rank {rank} {row['setting']}"
        for rank, rows in enumerate(per_rank)
        for row in rows
        if not _passed(row)
    ]
    total = sum(len(rows) for rows in per_rank)
    return PART.judged(
        failed,
        f"{total - len(failed)} of {total} captures replayed exactly as eager",
        budget_s,
        start=start,
        notes=["TP collectives are no-ops: gloo's cannot be captured in a CUDA graph."],
        details={"settings": list(SETTINGS), "ranks": per_rank},
        table=_table(per_rank),
    )
