"""How far one run's loss and gradients are from another's, and how far they may be.

Pure functions of :class:`StepResult` s (no model, no process group), used by
:mod:`lab.analysis.equivalence` and the GPU check. fp32: element-wise
``assert_close`` against stock (:data:`TOLERANCES`). bf16: norm-relative errors against an fp32
reference, Domino's held to a multiple of stock's own (:class:`RelativeErrorBound`); the
equivalence module's docstring says why.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = [
    "BF16_BOUND",
    "TOLERANCES",
    "RelativeErrorBound",
    "StepResult",
    "Tolerance",
    "bound_violations",
    "max_abs_error",
    "mismatches",
    "relative_errors",
    "worst_gradient_error",
]

#: ``torch.testing.assert_close`` tolerances against stock, for fp32 models only (bf16 models
#: are held to :data:`BF16_BOUND`); see :mod:`lab.analysis.equivalence`.
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: dict(atol=1e-6, rtol=1e-5),
}


@dataclass(frozen=True, kw_only=True)
class RelativeErrorBound:
    """How far a bf16 Domino run may be from the fp32 reference, tensor by tensor.

    For the loss and each gradient ``x`` with fp32 reference ``r``:
    ``error(x) = ||x - r|| / max(||r||, reference_floor * max_gradient_norm)``, and Domino
    passes where ``error(domino) <= max(ratio * error(stock), floor)``.
    """

    ratio: float = 1.5
    """Domino's error may be this multiple of stock's on the same tensor (Domino re-rounds the
    per-chunk weight-gradient sums; measured at most 1.25 on the CPU)."""
    floor: float = 2.0**-9
    """Errors up to one bf16 rounding (unit roundoff ``2**-9``) always pass: below it two
    bf16 runs differ by noise (the loss, computed in fp32 from bf16 logits, sits there)."""
    reference_floor: float = 1e-3
    """Guard for tensors whose fp32 norm is ~0: their error is taken relative to this share of
    the largest gradient norm instead of their own norm."""

    def limit(self, stock_error: float) -> float:
        """The largest error Domino may have on a tensor where stock's is ``stock_error``."""
        return max(self.ratio * stock_error, self.floor)

    def __str__(self) -> str:
        return f"per tensor vs fp32 <= max({self.ratio:g} x stock's, 2^-9)"


#: The bf16 criterion (:mod:`lab.analysis.equivalence` says why); see :class:`RelativeErrorBound`.
BF16_BOUND = RelativeErrorBound()

#: Element-wise ``assert_close`` tolerances against stock (fp32), or a bound against fp32 (bf16).
Tolerance = Mapping[str, float] | RelativeErrorBound


@dataclass(frozen=True)
class StepResult:
    """One forward and backward: per-token loss ``[b, s]`` and every gradient, by name."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor]


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


def relative_errors(
    result: StepResult, reference: StepResult, *, reference_floor: float = 1e-3
) -> dict[str, float]:
    """``||x - x_ref|| / ||x_ref||`` for ``"loss"`` and each gradient, in fp32.

    A gradient whose reference norm is below ``reference_floor`` times the largest reference
    gradient norm is divided by that instead (a ~0 gradient has no scale of its own).
    """
    norms = {name: float(grad.float().norm()) for name, grad in reference.grads.items()}
    smallest = reference_floor * max(norms.values(), default=0.0)
    pairs = [("loss", result.loss, reference.loss, float(reference.loss.float().norm()))]
    pairs += [
        (name, result.grads[name], grad, max(norms[name], smallest))
        for name, grad in reference.grads.items()
    ]
    errors = {}
    for name, actual, expected, scale in pairs:
        difference = float((actual.float() - expected.float()).norm())
        errors[name] = difference / scale if scale > 0 else (0.0 if difference == 0 else 1.0)
    return errors


def bound_violations(
    errors: Mapping[str, float], stock_errors: Mapping[str, float], bound: RelativeErrorBound
) -> list[str]:
    """``"name: ..."`` for each tensor where Domino's error exceeds ``bound`` given stock's."""
    return [
        f"{name}: Domino {errors[name]:.2e} vs fp32, limit {bound.limit(stock):.2e} "
        f"(stock {stock:.2e})"
        for name, stock in stock_errors.items()
        if not errors[name] <= bound.limit(stock)  # NaN fails too
    ]


def worst_gradient_error(errors: Mapping[str, float]) -> tuple[str, float]:
    """``(name, error)`` of the gradient with the largest error (the loss left out)."""
    return max(
        ((name, error) for name, error in errors.items() if name != "loss"),
        key=lambda pair: pair[1],
        default=("", 0.0),
    )
