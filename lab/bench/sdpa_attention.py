"""Causal core attention through torch's fused ``scaled_dot_product_attention``, as a layer spec.

Why: the DeepSpeed-Domino arm of the benchmark attends with
``F.scaled_dot_product_attention(is_causal=True)``, while Megatron-Core's local
``DotProductAttention`` materialises the ``[b, heads/tp, s, s]`` scores (``baddbmm``, masked
softmax, ``bmm``), a few per cent slower on the CPU. Giving the Megatron arms (baseline, oracle,
Domino) the same kernel makes the work inside every arm identical, so their times differ only
by how the communication is scheduled.

:class:`SDPACoreAttention` takes the constructor and call signature Megatron-Core 0.19.2's
``SelfAttention`` uses for ``core_attention`` (``CoreAttentionBuilder`` and
``CoreAttentionInterface`` in ``megatron/core/transformer/attention.py``); it has no
parameters, so a model built from :func:`sdpa_layer_spec` has the same state dict as the
stock local-spec model. It covers what the benchmark runs: multi-head causal self-attention
without dropout; anything else is refused when the model is built.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from lab.models.gpt_model import GPTOptions, GPTOptionsError, layer_spec

__all__ = ["SDPACoreAttention", "sdpa_layer_spec", "sdpa_problems"]


def sdpa_problems(options: GPTOptions) -> list[str]:
    """Why :func:`sdpa_layer_spec` cannot build ``options`` (empty when it can)."""
    problems = []
    if options.transformer_impl != "local":
        problems.append(
            f"--transformer-impl {options.transformer_impl}: the SDPA core attention replaces "
            "the local spec's DotProductAttention; use --transformer-impl local"
        )
    if options.resolved_num_query_groups != options.num_attention_heads:
        problems.append(
            f"--num-query-groups {options.resolved_num_query_groups} (grouped-query attention): "
            "the SDPA core attention is multi-head only; drop --num-query-groups"
        )
    if options.attention_dropout > 0:
        problems.append(
            f"--attention-dropout {options.attention_dropout}: the SDPA core attention has no "
            "dropout (Megatron's draws from its own RNG tracker); use --attention-dropout 0"
        )
    return problems


def sdpa_layer_spec(options: GPTOptions) -> ModuleSpec:
    """:func:`~lab.models.gpt_model.layer_spec` with :class:`SDPACoreAttention`.

    Pass it to ``build_gpt_model(options, spec=...)``. Everything else in the layer (norms,
    including the sequence-parallel ones, linears, MLP) is the local spec's.

    Raises:
        GPTOptionsError: ``options`` is not the local implementation, or asks for
            grouped-query attention or attention dropout (:func:`sdpa_problems`).
    """
    problems = sdpa_problems(options)
    if problems:
        raise GPTOptionsError("SDPA core attention: " + "; ".join(problems) + ".")
    spec = layer_spec(options)
    attention = spec.submodules.self_attention
    attention = dataclasses.replace(
        attention,
        submodules=dataclasses.replace(attention.submodules, core_attention=SDPACoreAttention),
    )
    return dataclasses.replace(
        spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention)
    )


class SDPACoreAttention(MegatronModule):
    """Causal multi-head attention of this rank's heads with one fused SDPA call.

    Shapes: query, key and value ``[sq, b, heads/tp, d]`` (already rotated, where the model
    uses RoPE) -> context ``[sq, b, heads/tp * d]``, the input of ``linear_proj``. The mask
    argument is ignored: causality comes from ``is_causal=True`` (the local spec's causal
    mask says the same), which keeps the kernel from reading an ``[s, s]`` mask.
    Under Domino's batch split each call sees one chunk ``[sq, b/p, ...]``; attention never
    mixes samples, so that is exact.

    Args: as Megatron-Core's ``DotProductAttention`` (what ``SelfAttention`` passes).
    Raises:
        ValueError: grouped-query attention, attention dropout, a non-causal mask type,
            context parallelism or a softmax variant (``softmax_type``, sliding window).
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ) -> None:
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        refused = {
            "grouped-query attention (num_query_groups != num_attention_heads)": (
                config.num_query_groups not in (None, config.num_attention_heads)
            ),
            f"attention dropout {dropout}": dropout > 0,
            f"mask type {attn_mask_type.name} (only causal)": attn_mask_type != AttnMaskType.causal,
            f"attention type {attention_type!r} (only self)": attention_type != "self",
            "context parallelism": config.context_parallel_size > 1,
            f"softmax_type {config.softmax_type!r}": config.softmax_type != "vanilla",
            "sliding-window attention": config.window_size is not None,
        }
        reasons = [reason for reason, bad in refused.items() if bad]
        if reasons:
            raise ValueError(
                "SDPACoreAttention computes multi-head causal self-attention without dropout; "
                f"it cannot run {', '.join(reasons)}. Build the model from the stock local "
                "spec instead."
            )
        head_dim = config.kv_channels
        # Megatron's query-key layer scaling divides the scale by the layer number and
        # multiplies it back inside the fp32 softmax: the same function, one scale here.
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """``[sq, b, np, d]`` x3 -> ``[sq, b, np * d]`` (``np`` = heads / TP)."""
        if attn_mask_type not in (None, AttnMaskType.causal):
            raise ValueError(f"SDPACoreAttention is causal only, got mask type {attn_mask_type}.")
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError(
                "SDPACoreAttention takes no attention bias or packed sequences; use the stock "
                "local spec or Transformer Engine's attention."
            )
        sq, b, heads, d = query.shape
        # [s, b, np, d] -> [b, np, s, d], the layout SDPA batches over.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        # [b, np, sq, d] -> [sq, b, np * d]
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * d)
