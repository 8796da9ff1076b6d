"""The training loop: one optimizer step, evaluation, and the iteration schedule around them.

A step is Megatron-Core's own: ``get_forward_backward_func()`` (one-forward-one-backward over
the pipeline stages under pipeline parallelism) runs every micro-batch's forward and backward, accumulating gradients in DDP's buffers and
reducing them over data-parallel ranks at the end, then the Megatron optimizer clips and
steps, and the scheduler advances by the step's samples (as in Megatron-LM, so warmup and
decay lengths in iterations mean the same thing at any batch size).

The loss is Megatron-LM's: the mean over all unmasked tokens of the global batch. Each
micro-batch reports ``[sum of token losses, token count]``; those are summed over
micro-batches and data-parallel ranks before dividing, so the logged value does not depend on
how the batch was split.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
from megatron.core import parallel_state
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_domino.training.reporting import Reporter

if TYPE_CHECKING:  # Domino's modules are imported only by runs that use them.
    from megatron_domino.training.domino_report import DominoOverlapReport

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class StepShape:
    """The per-step sizes every forward-backward call needs."""

    num_microbatches: int
    micro_batch_size: int
    seq_length: int
    global_batch_size: int


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step measured (see :class:`~.reporting.StepRecord`)."""

    loss: float
    learning_rate: float
    grad_norm: float | None
    skipped: bool
    seconds: float


def _loss_func(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """Megatron-LM's GPT loss: masked sum, token count, and both for cross-rank reporting.

    Returning the count lets the schedule divide the sum by the micro-batch's token count and
    by the number of micro-batches: the gradient is that of the micro-batches' mean per-token
    loss, as in Megatron-LM without ``--calculate-per-token-loss``.
    """
    mask = loss_mask.view(-1).float()
    loss = torch.sum(per_token_loss.view(-1).float() * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss.detach(), num_tokens.float()])
    return loss, num_tokens, {"lm loss": report}


def _forward_step(attention_mask: torch.Tensor, device: torch.device, data_iterator, model):
    """Megatron-Core's ``forward_step_func``: one micro-batch through the model.

    The explicit causal mask is passed because Megatron-Core's default mask is built on CUDA.
    """
    batch = {k: v.to(device, non_blocking=True) for k, v in next(data_iterator).items()}
    per_token_loss = model(
        input_ids=batch["tokens"],
        position_ids=batch["position_ids"],
        attention_mask=attention_mask,
        labels=batch["labels"],
    )
    return per_token_loss, partial(_loss_func, batch["loss_mask"])


def _mean_loss(reports: list[dict[str, torch.Tensor]], device: torch.device) -> float:
    """Token-weighted mean loss over micro-batches and data-parallel ranks, on every rank.

    Under pipeline parallelism only the last stage computes the loss (``reports`` is empty on
    the others); summing over the pipeline group hands it to every stage, rank 0's reporter
    included.
    """
    total = torch.zeros(2, device=device)
    for report in reports:
        total += report["lm loss"].to(device)
    torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(
            total, group=parallel_state.get_pipeline_model_parallel_group()
        )
    return (total[0] / total[1].clamp(min=1)).item()


class Trainer:
    """Runs steps and evaluations of one model; holds no state a checkpoint would need.

    Args:
        model: the DDP-wrapped model.
        attention_mask: boolean causal mask ``[1, 1, s, s]``, True where attention is blocked.
        device: where batches go.
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        optimizer: MegatronOptimizer,
        scheduler: OptimizerParamScheduler,
        shape: StepShape,
        attention_mask: torch.Tensor,
        device: torch.device,
    ) -> None:
        self._model = model
        self._optimizer = optimizer
        self._scheduler = scheduler
        self._shape = shape
        self._device = device
        self._forward_step = partial(_forward_step, attention_mask, device)
        self._forward_backward = get_forward_backward_func()

    def _run(self, data_iterator: Iterator[Batch], *, forward_only: bool) -> float:
        reports = self._forward_backward(
            forward_step_func=self._forward_step,
            data_iterator=data_iterator,
            model=self._model,
            num_microbatches=self._shape.num_microbatches,
            seq_length=self._shape.seq_length,
            micro_batch_size=self._shape.micro_batch_size,
            forward_only=forward_only,
        )
        return _mean_loss(reports, self._device)

    def train_step(self, data_iterator: Iterator[Batch]) -> StepResult:
        """One optimizer step over a global batch drawn from ``data_iterator``."""
        start = time.perf_counter()
        self._model.train()
        self._model.zero_grad_buffer()
        self._optimizer.zero_grad()
        loss = self._run(data_iterator, forward_only=False)
        learning_rate = self._optimizer.param_groups[0]["lr"]  # the one this step applies
        updated, grad_norm, _ = self._optimizer.step()
        if updated:
            self._scheduler.step(increment=self._shape.global_batch_size)
        _synchronize(self._device)
        return StepResult(
            loss=loss,
            learning_rate=learning_rate,
            grad_norm=None if grad_norm is None else float(grad_norm),
            skipped=not updated,
            seconds=time.perf_counter() - start,
        )

    @torch.no_grad()
    def evaluate(self, batches: Callable[[], Iterator[Batch]], eval_iters: int) -> float:
        """Mean loss over ``eval_iters`` global batches from a fresh ``batches()`` iterator.

        Evaluating on the same batches every time makes successive validation losses
        comparable, and keeps a resumed run's evaluations identical to an uninterrupted one.
        """
        self._model.eval()
        iterator = batches()
        losses = [self._run(iterator, forward_only=True) for _ in range(eval_iters)]
        return sum(losses) / len(losses)


def _synchronize(device: torch.device) -> None:
    """Wait for queued GPU work so step times measure it, not just its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(
    trainer: Trainer,
    reporter: Reporter,
    *,
    first_iteration: int,
    train_iters: int,
    train_batches: Iterator[Batch],
    eval_interval: int | None,
    eval_iters: int,
    valid_batches: Callable[[], Iterator[Batch]],
    save_interval: int | None,
    save: Callable[[int], None] | None,
    domino_report: DominoOverlapReport | None = None,
) -> None:
    """Run iterations ``first_iteration .. train_iters`` as Megatron-LM schedules them.

    Evaluates every ``eval_interval`` iterations and after the last one; saves every
    ``save_interval`` iterations and after the last one (``save`` is None without ``--save``).
    With ``domino_report`` (``--domino-report``), its iterations' steps are recorded and
    reported after their log record. Does nothing when a resumed checkpoint already reached
    ``train_iters``.
    """
    if first_iteration > train_iters:
        return
    evaluated = saved = None
    for iteration in range(first_iteration, train_iters + 1):
        recording = (
            domino_report.recording(iteration) if domino_report else contextlib.nullcontext()
        )
        with recording:
            step = trainer.train_step(train_batches)
        reporter.step(
            iteration,
            loss=step.loss,
            learning_rate=step.learning_rate,
            grad_norm=step.grad_norm,
            seconds=step.seconds,
            skipped=step.skipped,
        )
        if domino_report is not None:
            domino_report.report(iteration)
        if eval_interval and eval_iters and iteration % eval_interval == 0:
            reporter.evaluation(iteration, trainer.evaluate(valid_batches, eval_iters))
            evaluated = iteration
        if save is not None and save_interval and iteration % save_interval == 0:
            save(iteration)
            saved = iteration
    if eval_interval and eval_iters and evaluated != train_iters:
        reporter.evaluation(train_iters, trainer.evaluate(valid_batches, eval_iters))
    if save is not None and saved != train_iters:
        save(train_iters)
