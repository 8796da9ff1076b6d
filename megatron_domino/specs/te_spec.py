"""Transformer Engine's dense GPT layer with its norms apart: Domino's TE layer under ``--sequence-parallel``.

Megatron-Core's TE layer spec fuses each pre-linear norm into the column-parallel linear
(``TELayerNormColumnParallelLinear``). Under sequence parallelism stock TE then normalises this
rank's shard ``[s/tp, b, h]`` and all-gathers the *norm output* (FP8 bytes under delayed
scaling), keeping the shard for backward (TE ``module/layernorm_linear.py:283-301``). Domino
gathers ahead of the call, behind another chunk's work, so on the fused module it can only
gather the *pre-norm* residual and hand the norm the whole sequence: the norm runs ``tp`` times
redundantly, and its backward re-gathers what the fused module keeps of the whole chunk.

This spec builds the same layer with the norm a module of its own (Megatron-Core's ``TENorm``,
from the backend's ``layer_norm``) and a ``TEColumnParallelLinear``: Domino's norm op then
normalises the shard and gathers the norm output, exactly as for Megatron's local layers, and
the linear keeps the gathered input's shard (:mod:`megatron_domino.communication.saved_shards`).

Why not the fused module, running its norm and its GEMM apart: TE's ``LayerNormLinear`` has
no entry that takes an input normalised outside it, so running its GEMM alone would mean
calling TE's private ``_Linear`` autograd function (or ``Linear.forward`` on a
``LayerNormLinear``) with the module's weight cache, quantizers and fused weight-gradient
accumulation: Domino would depend on TE internals that change between releases.

Checkpoints are the fused layer's, both ways (:class:`TENormsApartLayer`): the parameters are
the fused layer's under other names, so the layer saves and loads them under the fused
layer's keys (``input_layernorm.`` is ``self_attention.linear_qkv.layer_norm_``, as
Megatron-Core's own local spec maps it), in ``torch_dist`` (``sharded_state_dict_keys_map``)
and plain ``state_dict`` form; the norms' own ``_extra_state`` (a TE norm is an ops module
with quantizer state, ``ops/op.py``; the fused layer keeps its FP8 state in the linear's, which
both layers save as ``linear_qkv._extra_state``) is left out of what the layer saves and
restored from the module on load, since no fused checkpoint has it.

Use it with ``--spec megatron_domino.specs.te_spec te_norms_apart_block_spec``, in
``pretrain_gpt_domino.py`` or Megatron-LM's patched ``pretrain_gpt.py``: both build the model
from ``gpt_config_from_args``, whose builder calls a spec function with the config and the
virtual stage (``megatron/training/models/gpt.py:273-281``). Under FP8 Domino gathers the norm
output in FP8, as stock TE does (:mod:`megatron_domino.communication.te_fp8_inputs`).
"""

from __future__ import annotations

import copy

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_domino.specs.block_specs import refuse_features, stage_block

__all__ = [
    "TENormsApartLayer",
    "TENormsApartMLPLayer",
    "self_attention_spec",
    "te_norms_apart_block_spec",
    "te_norms_apart_layer_spec",
]

#: This layer's parameter names -> the fused TE layer's (checkpoint keys).
FUSED_KEYS = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}
#: The norms' own TE state, which no fused checkpoint has.
_NORM_EXTRA_STATES = tuple(f"{apart}_extra_state" for apart in FUSED_KEYS)


class TENormsApartLayer(TransformerLayer):
    """Megatron-Core's ``TransformerLayer`` whose checkpoints are the fused TE layer's.

    ``torch_dist``: :meth:`sharded_state_dict` leaves the norms' ``_extra_state`` out (the
    parameters are mapped by ``sharded_state_dict_keys_map``). Plain ``state_dict``: saved
    under the fused layer's names without the norms' ``_extra_state``; a load renames the fused
    names back and takes the norms' ``_extra_state`` from the modules themselves.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_state_dict_post_hook(_save_as_fused)
        self.register_load_state_dict_pre_hook(_load_from_fused)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """Megatron's sharded state, without the norms' ``_extra_state``."""
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        for name in _NORM_EXTRA_STATES:
            sharded.pop(f"{prefix}{name}", None)
        return sharded


class TENormsApartMLPLayer(TENormsApartLayer, MLPLayer):
    """A ``HybridModel``'s MLP layer (``-``, Megatron-Core's ``MLPLayer``) of TE norms-apart
    layers: its checkpoints are the fused TE MLP layer's, as :class:`TENormsApartLayer`'s are
    (:mod:`megatron_domino.specs.hybrid_spec`)."""


def _save_as_fused(module, state_dict, prefix, local_metadata) -> None:
    """``state_dict`` post-hook: the norms' entries under the fused layer's names."""
    for name in _NORM_EXTRA_STATES:
        state_dict.pop(f"{prefix}{name}", None)
    for apart, fused in FUSED_KEYS.items():
        for key in [key for key in state_dict if key.startswith(prefix + apart)]:
            state_dict[prefix + fused + key[len(prefix + apart) :]] = state_dict.pop(key)


def _load_from_fused(module, state_dict, prefix, *args) -> None:
    """``load_state_dict`` pre-hook: the fused layer's names back to the norms', and the norms'
    ``_extra_state`` as the modules hold it (a HybridModel layer's absent norm, Megatron's
    identity, has none)."""
    for apart, fused in FUSED_KEYS.items():
        for key in [key for key in state_dict if key.startswith(prefix + fused)]:
            state_dict[prefix + apart + key[len(prefix + fused) :]] = state_dict.pop(key)
        norm = getattr(module, apart.rstrip("."))
        if not isinstance(norm, IdentityOp):
            state_dict.setdefault(f"{prefix}{apart}_extra_state", norm.get_extra_state())


def _te_backend():
    from megatron.core.models.gpt.gpt_layer_specs import TESpecProvider

    if TESpecProvider is None:
        raise ImportError(
            "megatron_domino.specs.te_spec builds Transformer Engine layers, and Transformer Engine "
            "does not import here; install it (pip install 'megatron-domino[gpu]') or use "
            "--transformer-impl local."
        )
    return TESpecProvider()


def self_attention_spec(backend, linear_qkv: type) -> ModuleSpec:
    """The dense TE layer's causal self-attention from ``backend``, with ``linear_qkv`` (fused
    norm + column linear, or the column linear alone)."""
    return ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=linear_qkv,
            core_attention=backend.core_attention(),
            linear_proj=backend.row_parallel_linear(),
            q_layernorm=IdentityOp,
            k_layernorm=IdentityOp,
        ),
    )


def te_norms_apart_layer_spec(backend=None, *, use_te_activation_func: bool = False) -> ModuleSpec:
    """The dense layer of Megatron-Core's TE spec, its two norms as modules of their own.

    Args:
        backend: a Megatron-Core ``BackendSpecProvider`` (default: ``TESpecProvider``). Its
            ``fuse_layernorm_and_linear`` is overridden.
        use_te_activation_func: the MLP's activation as TE's op (``TransformerConfig.
            use_te_activation_func``), as the stock TE spec builds it.
    """
    backend = backend or _te_backend()
    apart = copy.copy(backend)
    apart.__class__ = type(
        f"{type(backend).__name__}NormsApart",
        (type(backend),),
        {"fuse_layernorm_and_linear": lambda self: False},
    )
    attention = self_attention_spec(apart, apart.column_parallel_linear())
    return ModuleSpec(
        module=TENormsApartLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=apart.layer_norm(),
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=apart.layer_norm(),
            mlp=get_mlp_module_spec_for_backend(
                backend=apart, use_te_activation_func=use_te_activation_func
            ),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=dict(FUSED_KEYS),
        ),
    )


def te_norms_apart_block_spec(config, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """For ``--spec megatron_domino.specs.te_spec te_norms_apart_block_spec``: this pipeline stage's
    block of :func:`te_norms_apart_layer_spec` layers and TE's final norm. Called as
    :mod:`megatron_domino.specs.block_specs` says; raises ``ValueError`` for a layer feature this
    dense spec does not build, or for TE's op-fused MLP (``use_transformer_engine_op_fuser``:
    fc1, activation and fc2 as one fused op sequence, which Domino cannot split into its
    per-chunk ops)."""
    transformer = config.transformer
    refuse_features(
        config,
        (("use_transformer_engine_op_fuser", "use_transformer_engine_op_fuser"),),
        "Domino runs fc1 and fc2 as ops of their own, so TE's op-fused MLP ({flags}) is "
        "refused: turn {flags} off.",
    )
    refuse_features(
        transformer,
        (
            ("qk_layernorm", "--qk-layernorm"),
            ("num_moe_experts", "--num-experts"),
            ("multi_latent_attention", "--multi-latent-attention"),
        ),
        "--spec megatron_domino.specs.te_spec te_norms_apart_block_spec builds the dense layer "
        "only; drop {flags}.",
    )
    backend = _te_backend()
    layer = te_norms_apart_layer_spec(
        backend, use_te_activation_func=transformer.use_te_activation_func
    )
    return stage_block(layer, backend.layer_norm(), transformer, vp_stage)
