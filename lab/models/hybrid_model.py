"""Megatron-Core's ``HybridModel`` of attention (``*``) and MLP (``-``) layers, built from the
same options and layer specs as :mod:`lab.models.gpt_model`'s ``GPTModel``.

``HybridModel`` (megatron-core 0.19, ``--hybrid-layer-pattern``, Megatron-LM's
``pretrain_hybrid.py``) builds its ``HybridStack`` from one spec per layer kind;
:func:`megatron_domino.specs.hybrid_spec.hybrid_stack_spec` makes those two from the GPT layer
spec, so that a ``*-`` pair is ``GPTModel``'s layer cut in two.

``HybridStack`` builds its final norm as TE's ``TENorm`` whatever the spec
(``hybrid_block.py:215`` in 0.19.2), so a ``HybridModel`` needs Transformer Engine's Python,
also with local layers (the tests boot it on the CPU backend).
"""

from __future__ import annotations

import dataclasses

from megatron.core.models.hybrid.hybrid_layer_allocation import get_hybrid_total_layer_count
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.transformer.spec_utils import ModuleSpec

from lab.models.gpt_model import GPTOptions, layer_spec, stage_model_kwargs
from megatron_domino.specs.hybrid_spec import hybrid_stack_spec

__all__ = ["build_hybrid_model", "hybrid_options"]


def hybrid_options(options: GPTOptions, pattern: str) -> GPTOptions:
    """``options`` with as many layers as ``pattern`` (``--hybrid-layer-pattern``) has."""
    return dataclasses.replace(options, num_layers=get_hybrid_total_layer_count(pattern))


def build_hybrid_model(
    options: GPTOptions, pattern: str, *, spec: ModuleSpec | None = None
) -> HybridModel:
    """This rank's ``HybridModel`` for ``pattern`` (``*`` and ``-`` layers, ``|`` between
    pipeline segments), its layers the halves of ``spec`` (default :func:`layer_spec` of
    ``options``), the rest as :func:`~lab.models.gpt_model.build_gpt_model` builds a
    ``GPTModel``: same inputs (token ids ``[b, s]``, position ids, mask ``[1, 1, s, s]``), logits
    ``[b, s, V_pad / TP]`` or with ``labels`` the per-token loss ``[b, s]``.

    Needs ``megatron.core.parallel_state`` initialised and Transformer Engine's Python (module
    docstring).
    """
    options = hybrid_options(options, pattern)
    return HybridModel(
        hybrid_stack_spec=hybrid_stack_spec(spec or layer_spec(options)),
        hybrid_layer_pattern=pattern,
        **stage_model_kwargs(options),
    )
