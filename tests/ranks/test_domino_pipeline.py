"""Domino under pipeline parallelism: Megatron-Core's 1F1B schedule, stock vs Domino.

Four ranks: TP = 2 x PP = 2, each stage two of the model's four layers. Each rank builds its
stage, runs Megatron-Core's pipelined schedule (``get_forward_backward_func``: one forward
in warm-up, then one-forward-one-backward) over three micro-batches with the stock block, then
with Domino, and compares the per-micro-batch losses (last stage) and every gradient of its
stage, without and with sequence parallelism (where the norms' gradients are per-rank
partial sums in both runs, as in the single-stage SP tests), and with the sequence split. In 1F1B a stage runs the forward of micro-batch ``m + 1`` before the backward of
``m``, so Domino's backward collectives of one micro-batch are in flight across another's
forward: they must belong to their own step, not to the model.

Later stages take their input from the schedule (``set_input_tensor``), which Domino's block
forward reads as the stock one does. Tolerances: fp32 ``atol = 1e-6, rtol = 1e-5``
(:data:`lab.analysis.equivalence.TOLERANCES`).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from multiproc import run_on_ranks
from tiny_models import LLAMA_STYLE

from lab.analysis.equivalence import (
    StepResult,
    mismatches,
    token_batch,
    tolerance_for,
)
from lab.models.gpt_model import GPTOptions, build_gpt_model
from megatron_domino.apply import apply_domino
from megatron_domino.base.config import DominoConfig

MICRO_BATCHES = 3
MICRO_BATCH = 4
OPTIONS = GPTOptions(num_layers=4, **LLAMA_STYLE)


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(**batch)

    def loss_func(per_token_loss: torch.Tensor):
        loss = per_token_loss.float().mean()
        return loss, {"loss": loss.detach()}

    return output, loss_func


def _train_step(model, batches, options: GPTOptions) -> StepResult:
    """One pipelined forward and backward: the micro-batches' losses ``[m]`` (on the last
    stage; empty on the others) and this stage's gradients, compared with
    :func:`~lab.analysis.equivalence.mismatches`."""
    model.zero_grad(set_to_none=True)
    records = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches),
        seq_length=options.seq_length,
        micro_batch_size=MICRO_BATCH,
        forward_only=False,
    )
    losses = [record["loss"] for record in records]
    return StepResult(
        torch.stack(losses) if losses else torch.zeros(0),
        {name: p.grad.clone() for name, p in model.named_parameters()},
    )


def _compare(settings: dict, sequence_parallel: bool) -> dict:
    options = dataclasses.replace(OPTIONS, sequence_parallel=sequence_parallel)
    model = build_gpt_model(options)
    batches = [token_batch(options, MICRO_BATCH, seed=m) for m in range(MICRO_BATCHES)]
    reference = _train_step(model, batches, options)
    with apply_domino(model, DominoConfig(**settings)) as handle:
        result = _train_step(model, batches, options)
        assert not handle.runtime.last_step.pending_backward
    wrong = mismatches(result, reference, tolerance_for(options))
    assert not wrong, wrong[:3]
    return {
        "stage": parallel_state.get_pipeline_model_parallel_rank(),
        "losses": len(result.loss),
        "layers": len(model.decoder.layers),
    }


@pytest.mark.parametrize(
    "settings, sequence_parallel",
    [
        (dict(chunks=2), False),
        (dict(chunks=4), False),
        (dict(chunks=2, column_chunks=2), False),
        (dict(chunks=2), True),
        (dict(chunks=2, split_along="sequence"), False),
    ],
    ids=["p2", "p4", "p2-k2", "p2-sequence-parallel", "s2-sequence-split"],
)
def test_pipelined_training_step_matches_stock(settings, sequence_parallel):
    results = run_on_ranks(
        _compare, 4, args=(settings, sequence_parallel), pipeline_model_parallel_size=2
    )
    assert [r["stage"] for r in results] == [0, 0, 1, 1]
    assert [r["layers"] for r in results] == [2, 2, 2, 2]
    assert [r["losses"] for r in results] == [0, 0, MICRO_BATCHES, MICRO_BATCHES]
