"""Which of a Transformer Engine linear's FP8 quantizers Domino's own casts use, read from TE's
private ``_get_quantizers`` tuple by position, and the check that each position holds the
quantizer of the role Domino expects (TE's ``FP8FwdTensorIdx`` / ``FP8BwdTensorIdx`` slots).

Domino casts a column linear's input and a row linear's output gradient itself under FP8 and
sequence parallelism (:mod:`megatron_domino.communication.te_fp8_inputs`), with the quantizers
TE's own call would use. A TE outside the tested range may reorder that tuple: it is refused
when Domino is applied (:func:`quantizer_role_problems`, on a probe, since TE makes a module's
quantizers in its first FP8 call only) and checked again at each call.
"""

from __future__ import annotations

import torch

from megatron_domino.base.config import DominoUnsupportedError

__all__ = ["fp8_grad_output_quantizer", "fp8_input_quantizer", "quantizer_role_problems"]


def fp8_input_quantizer(module: torch.nn.Module):
    """The FP8 input quantizer ``module``'s next call will use, or ``None`` (not a TE module, or
    no FP8 autocast open).

    ``init_fp8_metadata`` is what the call's ``prepare_forward`` runs first (TE
    ``module/base.py:1552``): it reads the open ``fp8_autocast`` into ``module.fp8`` and builds
    the quantizers for its recipe (a no-op when they exist for that recipe); the input
    quantizer is the first of ``_get_quantizers`` (``module/linear.py:2007-2037``), the one the
    call quantizes its input with. Asked while the module still has its own settings
    (``parallel_mode="column"``, ``sequence_parallel=True``), so TE leaves the quantizer as its
    stock all-gather leaves it.
    """
    if not hasattr(module, "init_fp8_metadata"):  # TE's base module has it, Megatron's linears not
        return None
    module.init_fp8_metadata()
    if not module.fp8:
        return None
    quantizer = module._get_quantizers(False, False, torch.is_grad_enabled())[0]
    return _in_role(module, quantizer, 0)


def _in_role(module: torch.nn.Module, quantizer, position: int):
    """``quantizer``, read at ``position`` of ``module``'s ``_get_quantizers``, checked to be the
    one in the slot Domino expects there (:data:`_READ_SLOTS`): a TE outside the tested range
    may reorder that tuple. Checked when Domino is applied (:func:`quantizer_role_problems`, on
    a probe) and at each call.

    Raises:
        DominoUnsupportedError: another quantizer sits at that position.
    """
    if quantizer is not _slot(module, position):
        raise DominoUnsupportedError(_wrong_slot(type(module).__name__, position))
    return quantizer


#: The quantizers Domino reads from a TE linear's ``_get_quantizers(fp8_output=False,
#: fp8_grad=False, is_grad_enabled=True)``: position -> (what, scaling, the slot's role in
#: TE's ``FP8FwdTensorIdx`` / ``FP8BwdTensorIdx``).
_READ_SLOTS = {
    0: ("input", "scaling_fwd", "GEMM1_INPUT"),
    5: ("output-gradient", "scaling_bwd", "GRAD_OUTPUT1"),
}


def _slot(module: torch.nn.Module, position: int):
    """The quantizer in ``module``'s slot that Domino reads at ``position``."""
    from transformer_engine.pytorch.constants import FP8BwdTensorIdx, FP8FwdTensorIdx

    _, scaling, role = _READ_SLOTS[position]
    names = FP8FwdTensorIdx if scaling == "scaling_fwd" else FP8BwdTensorIdx
    return module.quantizers[scaling][getattr(names, role)]


def _wrong_slot(name: str, position: int, found: str = "keeps another quantizer there") -> str:
    what, scaling, role = _READ_SLOTS[position]
    return (
        f"Domino reads the {what} quantizer of {name} at position {position} of Transformer "
        f"Engine's _get_quantizers, and this TE {found} (not {scaling}[{role}]): its FP8 casts "
        "would use the wrong scales. Use a Transformer Engine in the tested range "
        "(megatron_domino.base.version.TESTED_TRANSFORMER_ENGINE), or train without --domino."
    )


def quantizer_role_problems(linear: torch.nn.Module, model_config) -> list[str]:
    """Why Domino cannot read the FP8 quantizers of TE linear ``linear``'s class by position
    (empty when it can), found when Domino is applied, before any FP8 call. TE makes a
    module's quantizers in its first FP8 call only, so the class's ``_get_quantizers`` runs on
    a probe: a ``16 x 16`` instance of its Transformer Engine base class on ``linear``'s
    device (zero-initialised: no random numbers drawn), inside Megatron-Core's FP8 context for
    ``model_config``'s recipe (under ``no_grad``: leaving it then updates no delayed-scaling
    state). The model's own modules
    are left untouched: their FP8 state, possibly loaded from a checkpoint, is theirs."""
    from megatron.core.fp8_utils import get_fp8_context

    name = type(linear).__name__
    te_class = next(
        c for c in type(linear).__mro__ if c.__module__.startswith("transformer_engine")
    )
    weight = linear.weight
    probe = te_class(  # zeros: its construction draws nothing from the RNG the model's init uses
        16, 16, bias=False, init_method=torch.nn.init.zeros_, params_dtype=weight.dtype,
        device=weight.device,
    )  # fmt: skip
    with torch.no_grad(), get_fp8_context(model_config):
        probe.init_fp8_metadata()
        try:
            quantizers = type(linear)._get_quantizers(probe, False, False, True)
        except TypeError as error:
            return [_wrong_slot(name, 0, f"takes other arguments ({error})")]
    problems = []
    for position in _READ_SLOTS:
        if len(quantizers) <= position:
            problems.append(_wrong_slot(name, position, "returns fewer quantizers"))
        elif quantizers[position] is not _slot(probe, position):
            problems.append(_wrong_slot(name, position))
    return problems


def fp8_grad_output_quantizer(module: torch.nn.Module):
    """The FP8 quantizer the backward of TE row linear ``module``'s last call casts its output
    gradient with, or ``None`` (not a TE module, or that call was not in FP8): the last of
    ``_get_quantizers`` (``module/linear.py:2024-2028``), asked with the module's own settings
    (``parallel_mode="row"``, ``sequence_parallel=True``) as stock's call asks it."""
    if not getattr(module, "fp8", False) or not hasattr(module, "_get_quantizers"):
        return None
    quantizer = module._get_quantizers(False, False, True)[5]
    return _in_role(module, quantizer, 5)
