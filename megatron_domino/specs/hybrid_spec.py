"""Layer specs for Megatron-Core's ``HybridModel`` (``--hybrid-layer-pattern``) that Domino runs:
its attention (``*``) and MLP (``-``) layers as the two halves of a dense GPT layer spec.

Megatron-Core's own ``hybrid_stack_spec`` fuses each norm into TE's column linear
(``TELayerNormColumnParallelLinear``), which Domino refuses under ``--sequence-parallel`` for the
reason :mod:`megatron_domino.specs.te_spec` gives. :func:`hybrid_stack_spec` makes a
``HybridStack`` spec from any GPT layer spec: the ``*`` layer is the GPT layer with its MLP, MLP
norm and MLP bias-dropout-add left to Megatron's identities, the ``-`` layer (``MLPLayer``) the
GPT layer with its attention, attention norm and attention bias-dropout-add left to them. So a
``*-`` pair computes what one GPT layer computes, with the same parameters under the same
names (its ``torch_dist`` keys are the fused layer's where the GPT spec maps them so), and a
``GPTModel`` checkpoint loads into it through Megatron-Core's GPT-to-hybrid translation
(``dist_checkpointing/gpt_checkpoint_interop.py``).

Two ready specs for ``--spec MODULE NAME`` (``HybridModelConfig`` takes the ``ModuleSpec``
itself, ``megatron/training/models/hybrid.py:151``, read from the module's namespace):

* ``megatron_domino.specs.te_hybrid_spec te_norms_apart_hybrid_stack_spec``: TE's layers with
  their norms apart (:func:`~megatron_domino.specs.te_spec.te_norms_apart_layer_spec`), the GPU
  path (that module imports Transformer Engine);
* ``megatron_domino.specs.hybrid_spec local_hybrid_stack_spec``: Megatron-Core's local layers
  with norms that run under sequence parallelism without Apex
  (:class:`~megatron_domino.specs.norms.SequenceParallelTorchNorm`), e.g. on the CPU.

``HybridStack`` builds its final norm as TE's ``TENorm`` whatever the spec
(``hybrid_block.py:215`` in megatron-core 0.19.2): a ``HybridModel`` needs Transformer Engine's
Python, with either spec.
"""

from __future__ import annotations

import dataclasses

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_domino.specs.norms import SequenceParallelTorchNorm
from megatron_domino.specs.te_spec import TENormsApartLayer, TENormsApartMLPLayer

__all__ = ["hybrid_stack_spec", "local_hybrid_stack_spec", "local_layer_spec"]


#: The MLP layer's class for a GPT layer class that differs from Megatron's (checkpoint keys).
_MLP_LAYERS = {TENormsApartLayer: TENormsApartMLPLayer}


def hybrid_stack_spec(layer: ModuleSpec) -> ModuleSpec:
    """The ``HybridStack`` spec whose ``*`` and ``-`` layers are the two halves of the GPT layer
    spec ``layer`` (module docstring); the other layer kinds stay unset (Megatron's identity),
    and Domino refuses them."""
    submodules = layer.submodules
    attention = dataclasses.replace(
        submodules, pre_mlp_layernorm=IdentityOp, mlp=IdentityOp, mlp_bda=IdentityFuncOp
    )
    mlp = dataclasses.replace(
        submodules,
        input_layernorm=IdentityOp,
        self_attention=IdentityOp,
        self_attn_bda=IdentityFuncOp,
    )
    return ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(
            attention_layer=ModuleSpec(module=layer.module, submodules=attention),
            mlp_layer=ModuleSpec(module=_MLP_LAYERS.get(layer.module, MLPLayer), submodules=mlp),
        ),
    )


def local_layer_spec() -> ModuleSpec:
    """Megatron-Core's local GPT layer with :class:`SequenceParallelTorchNorm` norms (the
    normalization the config names, with or without sequence parallelism)."""
    spec = get_gpt_layer_local_spec()
    norms = dict(
        input_layernorm=SequenceParallelTorchNorm, pre_mlp_layernorm=SequenceParallelTorchNorm
    )
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **norms))


#: ``--spec megatron_domino.specs.hybrid_spec local_hybrid_stack_spec``: Megatron-Core's local
#: layers (module docstring).
local_hybrid_stack_spec = hybrid_stack_spec(local_layer_spec())
