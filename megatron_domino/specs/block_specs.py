"""What the ``--spec`` builders of this project share: refusing the layer features a spec does
not build, and the pipeline stage's block of one layer spec.

Megatron-LM calls a ``--spec MODULE FUNCTION`` as ``FUNCTION(gpt_model_config, vp_stage=...)``
and builds the model from what it returns (``megatron/training/models/gpt.py:273-281``,
``core_r0.19.0``): ``config`` is Megatron-LM's ``GPTModelConfig`` (its ``transformer`` the
``TransformerConfig``), ``vp_stage`` the virtual pipeline stage being built, or ``None``. A
builder returns a block spec, so that it picks the final norm too.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

__all__ = ["refuse_features", "stage_block"]


def refuse_features(transformer, features: Sequence[tuple[str, str]], message: str) -> None:
    """Raise ``ValueError`` if ``transformer`` (the ``TransformerConfig``) turns on any of
    ``features``, ``(config attribute, the flag that sets it)`` pairs: ``message`` formatted
    with ``flags``, the flags found, joined by commas."""
    flags = [flag for name, flag in features if getattr(transformer, name, None)]
    if flags:
        raise ValueError(message.format(flags=", ".join(flags)))


def stage_block(
    layer: ModuleSpec, final_norm, transformer, vp_stage: int | None
) -> TransformerBlockSubmodules:
    """The block this (virtual) pipeline stage builds: ``layer`` for each of its layers, then
    ``final_norm``."""
    layers = get_num_layers_to_build(transformer, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * layers, layer_norm=final_norm)
