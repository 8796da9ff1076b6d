"""Domino against unpatched Megatron-Core on the same model, weights and batch.

The comparison the test suite makes on the CPU and ``python -m megatron_domino.gpu_check``
makes on a GPU: run a forward and backward with the stock block (the reference), then with
Domino applied for each setting, then once more after ``revert``, and compare the per-token
loss ``[b, s]`` and every parameter's gradient with the reference.

Tolerances (:data:`TOLERANCES`). fp32: ``atol = 1e-6, rtol = 1e-5``. Domino splits the batch
(GEMMs with fewer rows) and, with column pieces, sums the output projection's pieces
separately, so only the order of floating-point sums changes; measured differences on the CPU
are below 1e-7. bf16: ``atol = rtol = 2e-2`` (a few bf16 ulps, 2**-8 = 4e-3 relative), since
every reordered bf16 sum rounds. A schedule bug (a chunk's output added to the wrong residual,
a missing piece) gives differences of the order of the values themselves.

Revert: the model after ``revert`` must reproduce the reference exactly, up to the
run-to-run difference of two stock runs (:attr:`StockComparison.stock_noise`). That is 0 on
the CPU; on a GPU, deterministic algorithms should make it 0 too (not yet seen on a device).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from megatron_domino.config import DominoConfig
from megatron_domino.gpt_model import GPTOptions, causal_attention_mask
from megatron_domino.integration import apply_domino

__all__ = [
    "TOLERANCES",
    "SettingComparison",
    "StepResult",
    "StockComparison",
    "compare_with_stock",
    "forward_backward",
    "max_abs_error",
    "mismatches",
    "tolerance_for",
    "token_batch",
]

#: ``torch.testing.assert_close`` tolerances by parameter dtype; see the module docstring.
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: dict(atol=1e-6, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def tolerance_for(options: GPTOptions) -> dict[str, float]:
    """The tolerance for a model built from ``options`` (bf16 or fp32)."""
    return TOLERANCES[torch.bfloat16 if options.bf16 else torch.float32]


def token_batch(
    options: GPTOptions,
    micro_batch_size: int,
    *,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """The same batch on every rank: token ids, positions and labels ``[b, s]``, mask
    ``[1, 1, s, s]``.

    Drawn from a CPU generator seeded with ``seed`` (so identical on every rank and device),
    then moved to ``device``.
    """
    generator = torch.Generator().manual_seed(seed)
    b, s = micro_batch_size, options.seq_length
    batch = {
        "input_ids": torch.randint(0, options.vocab_size, (b, s), generator=generator),
        "position_ids": torch.arange(s).expand(b, s),
        "attention_mask": causal_attention_mask(s, "cpu"),
        "labels": torch.randint(0, options.vocab_size, (b, s), generator=generator),
    }
    return {name: tensor.to(device) for name, tensor in batch.items()}


@dataclass(frozen=True)
class StepResult:
    """One forward and backward: per-token loss ``[b, s]`` and every gradient, by name."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor]


def forward_backward(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> StepResult:
    """Per-token loss ``[b, s]`` and the gradients of its mean (in fp32), by parameter name."""
    model.zero_grad(set_to_none=True)
    loss = model(**batch)
    loss.float().mean().backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return StepResult(loss.detach(), grads)


def max_abs_error(result: StepResult, reference: StepResult) -> float:
    """The largest absolute difference over the loss and every gradient."""
    errors = [(result.loss.float() - reference.loss.float()).abs().max()]
    errors += [
        (result.grads[name].float() - grad.float()).abs().max()
        for name, grad in reference.grads.items()
    ]
    return float(max(errors))


def mismatches(
    result: StepResult, reference: StepResult, tolerance: Mapping[str, float]
) -> list[str]:
    """``"name: message"`` for the loss and each gradient outside ``tolerance``, in order."""
    pairs = [("loss", result.loss, reference.loss)]
    pairs += [(name, result.grads[name], grad) for name, grad in reference.grads.items()]
    found = []
    for name, actual, expected in pairs:
        try:
            torch.testing.assert_close(actual, expected, **tolerance)
        except AssertionError as error:
            found.append(f"{name}: {' '.join(str(error).split())}")
    return found


@dataclass(frozen=True)
class SettingComparison:
    """One Domino setting against the stock block.

    Attributes:
        max_error: largest absolute difference (loss and every gradient).
        mismatches: what fell outside the tolerance (empty when it passed).
        left_pending: collectives still in flight after the step (must be 0).
        dgrad_slots: input-gradient all-reduces Domino launched in backward.
    """

    setting: str
    max_error: float
    mismatches: list[str]
    left_pending: int
    dgrad_slots: int

    @property
    def passed(self) -> bool:
        return not self.mismatches and self.left_pending == 0


@dataclass(frozen=True)
class StockComparison:
    """Every setting of :func:`compare_with_stock`, plus the revert check.

    Attributes:
        revert_error: largest difference of a stock run after ``revert`` from the reference.
        stock_noise: largest difference between two stock runs before Domino was applied.
    """

    settings: dict[str, SettingComparison] = field(default_factory=dict)
    revert_error: float = 0.0
    stock_noise: float = 0.0

    @property
    def reverted(self) -> bool:
        """Whether the reverted model reproduces the reference (up to the stock noise)."""
        return self.revert_error <= self.stock_noise


def compare_with_stock(
    model: torch.nn.Module,
    batch: Mapping[str, torch.Tensor],
    configs: Mapping[str, DominoConfig],
    tolerance: Mapping[str, float],
) -> StockComparison:
    """Run the stock block, then Domino per ``configs`` entry, then stock again after revert.

    Runs on every rank of the tensor-parallel group (the collectives need all of them); the
    numbers are this rank's. Nothing is raised for a mismatch: the caller reads
    :attr:`SettingComparison.passed` and :attr:`StockComparison.reverted`.
    """
    reference = forward_backward(model, batch)
    stock_noise = max_abs_error(forward_backward(model, batch), reference)
    settings = {}
    for setting, config in configs.items():
        with apply_domino(model, config) as handle:
            result = forward_backward(model, batch)
            step = handle.runtime.last_step
            left_pending = len(step.pending_forward) + len(step.pending_backward)
            dgrad_slots = len(step.dgrad_slots)
        settings[setting] = SettingComparison(
            setting=setting,
            max_error=max_abs_error(result, reference),
            mismatches=mismatches(result, reference, tolerance),
            left_pending=left_pending,
            dgrad_slots=dgrad_slots,
        )
    revert_error = max_abs_error(forward_backward(model, batch), reference)
    return StockComparison(settings=settings, revert_error=revert_error, stock_noise=stock_noise)
