"""A layer spec for Megatron-LM's ``--spec`` flag: the local spec, with norms that run under
``--sequence-parallel`` without Apex (e.g. on the CPU).

    pretrain_gpt_domino.py --transformer-impl local --sequence-parallel \
        --spec megatron_domino.specs.cpu_specs sequence_parallel_local_spec ...

Megatron-LM builds ``--transformer-impl local`` models from Megatron-Core's
``get_gpt_layer_local_spec``, whose norms (each layer's two and the block's final one) are
Apex's ``FusedLayerNorm``, which needs CUDA, or without Apex ``WrappedTorchNorm``, which
asserts ``not config.sequence_parallel`` (``core/transformer/torch_norm.py:50``, megatron-core
0.19.2). This spec is that same local spec with those three norms replaced by
:class:`~megatron_domino.specs.norms.SequenceParallelTorchNorm` (torch's ``LayerNorm``/``RMSNorm``,
weights marked ``sequence_parallel`` so that Megatron all-reduces their gradients over the
tensor-parallel group, as it does Apex's). Nothing else changes.

``--spec MODULE FUNCTION`` makes Megatron-LM call ``FUNCTION(gpt_model_config, vp_stage=...)``
and build the model from what it returns (``megatron/training/models/gpt.py:273-281``); a
block spec is returned so that the final norm is replaced too. Features whose norms this spec
would silently get wrong are refused.
"""

from __future__ import annotations

import dataclasses

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_domino.specs.block_specs import refuse_features, stage_block
from megatron_domino.specs.norms import SequenceParallelTorchNorm

__all__ = ["sequence_parallel_local_spec"]

#: (TransformerConfig attribute, the flag that sets it): norms this spec does not build.
_REFUSED = (
    ("layernorm_zero_centered_gamma", "--apply-layernorm-1p"),
    ("qk_layernorm", "--qk-layernorm"),
    ("memory_efficient_layer_norm", "--memory-efficient-layer-norm"),
    ("num_moe_experts", "--num-experts"),
    ("multi_latent_attention", "--multi-latent-attention"),
    ("experimental_attention_variant", "--experimental-attention-variant"),
    ("use_kitchen", "--use-kitchen"),
)


def sequence_parallel_local_spec(config, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """This pipeline stage's block spec: the local layer spec with sequence-parallel norms.
    Called as :mod:`megatron_domino.specs.block_specs` says; raises ``ValueError`` for a feature
    whose norms this spec does not build."""
    transformer = config.transformer
    refuse_features(
        transformer,
        _REFUSED,
        "--spec megatron_domino.specs.cpu_specs sequence_parallel_local_spec does not build the "
        "norms of {flags}; drop them or use Megatron's Apex/TE norms on a GPU.",
    )
    spec = get_gpt_layer_local_spec(normalization=transformer.normalization)
    norms = dict(
        input_layernorm=SequenceParallelTorchNorm, pre_mlp_layernorm=SequenceParallelTorchNorm
    )
    layer = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **norms))
    return stage_block(layer, SequenceParallelTorchNorm, transformer, vp_stage)
