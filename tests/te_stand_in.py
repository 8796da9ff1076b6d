"""CPU stand-ins for Megatron-Core's Transformer Engine linears, keeping the contract Domino uses.

Transformer Engine needs CUDA, so the CPU tests cannot build ``TERowParallelLinear`` or
``TELayerNormColumnParallelLinear``. These stand-ins reuse Megatron's local linears for the
weights (same shapes, initialisation and TP attributes) and reproduce, in plain torch, what
:mod:`megatron_domino.te_linears` relies on in the real ones (read from TE ``v2.18``'s source
and Megatron-Core 0.19's wrappers in ``megatron/core/extensions/transformer_engine.py``):

* the collectives are chosen on every call from ``parallel_mode`` and ``sequence_parallel``:
  row: all-reduce the output (reduce-scatter under SP); column: forward copy with a backward
  all-reduce of the input gradient (under SP: all-gather the norm output, backward
  reduce-scatter). With ``parallel_mode=None`` there is none;
* what the column linear keeps for backward: under SP, TE's ``LayerNormLinear`` keeps its
  input and norm output as this rank's shards ``[s/tp, b, h]`` and all-gathers the norm output
  again in backward. The stand-in runs its GEMM through Megatron's own column GEMM
  (``_forward_impl``), which keeps the same shard and re-gathers it the same way, so the
  stand-in saves what TE saves;
* ``fuse_wgrad_accumulation`` (``gradient_accumulation_fusion``): both stand-ins' GEMMs
  (Megatron's ``_forward_impl``) then accumulate the weight gradient into ``main_grad`` with
  Megatron's fused weight-gradient GEMM, as TE accumulates into ``main_grad`` with its own;
* the column linear normalises its input itself (the layer's own norm is ``IdentityOp``);
  under SP it normalises the sequence shard and then gathers, and its norm parameters are
  marked ``sequence_parallel`` (so ``finalize_model_grads`` sums their gradients over TP);
* ``te_return_bias`` (the bias is returned, not added) and ``use_bias``;
* Megatron's wrapper passes ``is_first_microbatch`` (``None`` when
  ``disable_parameter_transpose_cache``) and then sets it to False. The stand-ins record what
  they were passed, and whether a ``fp8_autocast`` stand-in (:data:`FP8_CONTEXT_DEPTH`) was
  open, in ``calls``.

* under :func:`fp8_stand_in` (TE's ``fp8_autocast``), TE 2.x's FP8 weight contract
  (:mod:`te_fp8_stand_in`): the weight cast and its cache keyed by ``is_first_microbatch``
  (casts counted in ``fp8_casts``), an uncached FP8 weight saved as rank-specific plain
  ``uint8`` data and transpose, the input-gradient GEMM reading the transpose, ``main_grad``
  overwritten by a call flagged first, and ``get_dummy_wgrad``'s shared placeholder.

* under :func:`fp8_stand_in`, the FP8 cast of every linear's input by the module's input
  quantizer (``init_fp8_metadata``, ``_get_quantizers``), an input that arrives already in FP8
  used as it is, the FP8 all-gather of the cast shard under SP, and what TE keeps of the input
  (the FP8 shard, the column-wise copy, or the FP8 input object; :mod:`te_fp8_stand_in`).

What they do not model: TE's fused kernels and
its fused norm's own saved tensors (the stand-in's norm is torch's, whose fp32 intermediates
Domino's saved-shard rule keeps whole), Userbuffers, and the per-module quantization context
0.19's wrappers enter around each call (only with ``quant_recipe``, which Domino refuses).

:class:`StandInTEDotProductAttention` stands in for ``TEDotProductAttention`` (the TE spec's
core attention; ``stand_in_te_layer_spec(te_attention=True)``), keeping the call contract
Megatron's wrapper has with TE's ``DotProductAttention`` (TE >= 0.12, ``qkv_format="sbhd"``):
Megatron passes ``attn_mask_type.name`` on every call, and TE's mask-type semantics
(:func:`te_attention_reference`, from TE's ``DotProductAttention.forward`` docstring):
``"causal"`` is aligned to the *top-left* corner of the ``[sq, sk]`` scores (query ``i`` sees
keys ``j <= i``), ``"causal_bottom_right"`` to the bottom-right (``j <= i + sk - sq``); for both
(and ``"no_mask"``) the mask tensor is not used; ``"arbitrary"`` applies it (True = masked).
Grouped-query attention (``num_gqa_groups``), ``softmax_scale`` (default ``1/sqrt(d)``) and
attention dropout in the TP RNG fork unless sequence parallel. Not modelled: padding masks,
packed sequences, attention bias, sliding windows, FP8 attention, TE's backend selection.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from te_fp8_stand_in import Float8Quantizer, Fp8Linear, gather_along_first_dim, quantize_weight

from megatron_domino import te_fp8_inputs
from megatron_domino.harness.norms import SequenceParallelTorchNorm
from megatron_domino.row_output import output_dtype_option
from megatron_domino.te_spec import self_attention_spec, te_norms_apart_layer_spec

# TE's FP8-aware all-gather, which Domino calls for an FP8 input (modelled: te_fp8_stand_in).
te_fp8_inputs.gather_along_first_dim = gather_along_first_dim

#: How many fp8_autocast stand-ins are open (see ``tests/ranks/test_te_linears.py``); while one is,
#: the linears run TE 2.x's FP8 weight contract (:mod:`te_fp8_stand_in`).
FP8_CONTEXT_DEPTH = [0]


@contextlib.contextmanager
def fp8_stand_in():
    """TE's ``fp8_autocast`` for the stand-ins: FP8 weight casts, caches and saves inside."""
    FP8_CONTEXT_DEPTH[0] += 1
    try:
        yield
    finally:
        FP8_CONTEXT_DEPTH[0] -= 1


@dataclasses.dataclass(frozen=True)
class Call:
    """One forward call: the settings it ran with."""

    parallel_mode: str | None
    sequence_parallel: bool
    is_first_microbatch: bool | None
    in_fp8_context: bool


class _TEWrapperContract:
    """The attributes and call protocol of Megatron's TE wrappers (``TELinear`` etc.)."""

    def _init_te(self, parallel_mode: str, config, bias: bool, skip_bias_add: bool) -> None:
        self.parallel_mode = parallel_mode
        self.use_bias = bias
        self.te_return_bias = skip_bias_add and bias
        self.is_first_microbatch = True
        self.disable_parameter_transpose_cache = config.disable_parameter_transpose_cache
        self.fuse_wgrad_accumulation = config.gradient_accumulation_fusion
        self.calls: list[Call] = []
        #: TE's per-module FP8 weight cache (``module/base.py``) and how often it cast.
        self._fp8_workspaces: dict = {}
        self.fp8_casts = 0
        #: TE's FP8 state of the module (``init_fp8_metadata``) and its quantizers.
        self.fp8 = False
        self.quantizers: dict | None = None

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        """TE ``module/base.py:1462-1507``: ``fp8`` follows the open ``fp8_autocast``; the
        quantizers are built on the first FP8 call (a recipe change is not modelled)."""
        self.fp8 = FP8_CONTEXT_DEPTH[0] > 0
        if self.fp8 and self.quantizers is None:
            self.quantizers = {"scaling_fwd": [Float8Quantizer()]}

    def _get_quantizers(self, fp8_output: bool, fp8_grad: bool, is_grad_enabled: bool) -> list:
        """TE ``module/linear.py:2007-2037``: the input quantizer first, made ``internal`` (the
        weight's and the gradients' are not modelled here: ``None``)."""
        if not self.fp8:
            return [None] * 6
        input_quantizer = self.quantizers["scaling_fwd"][0]
        input_quantizer.internal = True
        return [input_quantizer, None, None, None, None, None]

    def _start_call(self) -> bool | None:
        """Record the call; the ``is_first_microbatch`` TE gets (Megatron's wrapper's rule)."""
        first = None if self.disable_parameter_transpose_cache else self.is_first_microbatch
        self.calls.append(
            Call(self.parallel_mode, self.sequence_parallel, first, FP8_CONTEXT_DEPTH[0] > 0)
        )
        self.is_first_microbatch = False
        return first

    def _fp8_gemm(self, input_, bias, first: bool | None, **collectives):
        """TE 2.x's FP8 GEMM of this call (:class:`te_fp8_stand_in.Fp8Linear`)."""
        self.init_fp8_metadata()  # base.py:1552, in prepare_forward
        options = dict(
            fuse_wgrad=self.fuse_wgrad_accumulation,
            is_first_microbatch=first,
            input_quantizer=self._get_quantizers(False, False, torch.is_grad_enabled())[0],
            **collectives,
        )
        fp8_weight = quantize_weight(self, first)
        return Fp8Linear.apply(input_, self.weight, bias, fp8_weight, options)

    def _outputs(self, output: torch.Tensor):
        return (output, self.bias) if self.te_return_bias else (output, None)


class StandInTERowParallelLinear(_TEWrapperContract, RowParallelLinear):
    """``TERowParallelLinear``'s contract over Megatron's local row-parallel weights."""

    def __init__(self, input_size, output_size, *, config, bias, skip_bias_add, **kwargs):
        super().__init__(
            input_size, output_size, config=config, bias=bias, skip_bias_add=True, **kwargs
        )
        self._init_te("row", config, bias, skip_bias_add)

    def forward(self, input_: torch.Tensor):
        """``[s, b, n/tp]`` -> ``([s or s/tp, b, h], bias-or-None)``."""
        first = self._start_call()
        if FP8_CONTEXT_DEPTH[0] > 0:
            output = self._fp8_gemm(input_, None, first)
        else:
            output = self._forward_impl(
                input=input_,
                weight=self.weight,
                bias=None,
                gradient_accumulation_fusion=(
                    self.fuse_wgrad_accumulation and hasattr(self.weight, "main_grad")
                ),
                allreduce_dgrad=False,
                sequence_parallel=False,
                tp_group=self.tp_group,
                **output_dtype_option(self),
            )
        if self.parallel_mode == "row" and self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(output, group=self.tp_group)
        elif self.parallel_mode == "row":
            output = reduce_from_tensor_model_parallel_region(output, group=self.tp_group)
        if self.use_bias and not self.te_return_bias:
            output = output + self.bias
        return self._outputs(output)


class StandInTEColumnParallelLinear(_TEWrapperContract, ColumnParallelLinear):
    """``TEColumnParallelLinear``'s contract (no norm: the layer's own ``TENorm`` precedes it,
    :mod:`megatron_domino.te_spec`)."""

    def __init__(self, input_size, output_size, *, config, bias, skip_bias_add, **kwargs):
        super().__init__(
            input_size, output_size, config=config, bias=bias, skip_bias_add=True, **kwargs
        )
        self._init_te("column", config, bias, skip_bias_add)

    def _normed(self, input_: torch.Tensor) -> torch.Tensor:
        return input_

    def forward(self, input_: torch.Tensor):
        """``[s or s/tp, b, h]`` -> ``([s, b, n/tp], bias-or-None)``."""
        first = self._start_call()
        normed = self._normed(input_)
        column = self.parallel_mode == "column"
        bias = None if self.te_return_bias or not self.use_bias else self.bias
        if FP8_CONTEXT_DEPTH[0] > 0:
            output = self._fp8_gemm(
                normed,
                bias,
                first,
                gather=self.tp_group if column and self.sequence_parallel else None,
                allreduce_group=self.tp_group if column and not self.sequence_parallel else None,
            )
            return self._outputs(output)
        output = self._forward_impl(
            input=normed,
            weight=self.weight,
            bias=bias,
            gradient_accumulation_fusion=(
                self.fuse_wgrad_accumulation and hasattr(self.weight, "main_grad")
            ),
            allreduce_dgrad=column and not self.sequence_parallel,
            sequence_parallel=column and self.sequence_parallel,
            tp_group=self.tp_group,
            **output_dtype_option(self),
        )
        return self._outputs(output)


class StandInTELayerNormColumnParallelLinear(StandInTEColumnParallelLinear):
    """``TELayerNormColumnParallelLinear``'s contract: norm fused before the column GEMM."""

    def __init__(self, input_size, output_size, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.norm = SequenceParallelTorchNorm(config, input_size, eps=config.layernorm_epsilon)

    def _normed(self, input_: torch.Tensor) -> torch.Tensor:
        return self.norm(input_)


class StandInTESpecProvider(LocalSpecProvider):
    """Megatron's ``TESpecProvider`` for the dense layer: the stand-in linears, norms fused
    into the column-parallel ones, and Megatron's local attention (TE's needs CUDA)."""

    def __init__(self, *, te_attention: bool = False) -> None:
        super().__init__()
        self.te_attention = te_attention

    def core_attention(self) -> type:
        """:class:`StandInTEDotProductAttention` with ``te_attention``, else Megatron's local
        ``DotProductAttention``."""
        return StandInTEDotProductAttention if self.te_attention else super().core_attention()

    def row_parallel_linear(self) -> type:
        return StandInTERowParallelLinear

    def column_parallel_linear(self) -> type:
        return StandInTEColumnParallelLinear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False):
        """``TENorm``: follows ``config.normalization``, runs under sequence parallelism and
        marks its weights ``sequence_parallel``."""
        return SequenceParallelTorchNorm

    def fuse_layernorm_and_linear(self) -> bool:
        return True

    def column_parallel_layer_norm_linear(self) -> type:
        return StandInTELayerNormColumnParallelLinear


def stand_in_te_norms_apart_layer_spec(*, te_attention: bool = False) -> ModuleSpec:
    """:func:`megatron_domino.te_spec.te_norms_apart_layer_spec` on the stand-ins: the layer
    Domino runs on TE under ``--sequence-parallel`` (norm modules of their own)."""
    return te_norms_apart_layer_spec(StandInTESpecProvider(te_attention=te_attention))


def stand_in_te_layer_spec(*, te_attention: bool = False) -> ModuleSpec:
    """The dense layer of Megatron's TE spec (``get_gpt_layer_with_transformer_engine_spec``),
    shape for shape, built from :class:`StandInTESpecProvider`: the layer's own norms are
    ``IdentityOp`` (the fused norms follow ``config.normalization``, as TE's do), and the MLP
    is a ``functools.partial`` of ``MLP.as_mlp_submodule`` whose fc1 has the norm fused in.
    With ``te_attention`` the core attention is :class:`StandInTEDotProductAttention` (as in
    the TE spec), else Megatron's local ``DotProductAttention``.
    """
    backend = StandInTESpecProvider(te_attention=te_attention)
    attention = self_attention_spec(backend, backend.column_parallel_layer_norm_linear())
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=IdentityOp,
            mlp=get_mlp_module_spec_for_backend(backend=backend),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def stand_in_linears(model: torch.nn.Module) -> list[_TEWrapperContract]:
    return [m for m in model.modules() if isinstance(m, _TEWrapperContract)]


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """One call of the attention stand-in: the mask type TE got, and the shapes."""

    attn_mask_type: str
    sq: int
    sk: int
    mask_given: bool


def te_attention_probs(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    attn_mask_type: str,
    *,
    softmax_scale: float,
) -> torch.Tensor:
    """TE's attention probabilities ``[b, np, sq, sk]`` for ``query [sq, b, np, d]`` and
    ``key [sk, b, ng, d]``, with TE's mask-type semantics (see the module docstring)."""
    sq, sk = query.shape[0], key.shape[0]
    if attn_mask_type in ("causal", "causal_bottom_right"):
        shift = sk - sq if attn_mask_type == "causal_bottom_right" else 0
        ones = torch.ones(sq, sk, dtype=torch.bool, device=query.device)
        masked = torch.triu(ones, diagonal=1 + shift)  # True: key j > i + shift
    elif attn_mask_type == "no_mask":
        masked = None
    elif attn_mask_type == "arbitrary":
        masked = attention_mask
    else:
        raise NotImplementedError(f"the TE attention stand-in does not model {attn_mask_type!r}")
    key = key.repeat_interleave(query.shape[2] // key.shape[2], dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", query.float(), key.float()) * softmax_scale
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    return torch.softmax(scores, dim=-1).to(query.dtype)


def attention_context(probs: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``probs [b, np, sq, sk]`` applied to ``value [sk, b, ng, d]``: ``[sq, b, np*d]``."""
    value = value.repeat_interleave(probs.shape[1] // value.shape[2], dim=2)
    context = torch.einsum("bhqk,kbhd->qbhd", probs, value)
    return context.reshape(context.shape[0], context.shape[1], -1)


class StandInTEDotProductAttention(torch.nn.Module):
    """``TEDotProductAttention``'s contract (see the module docstring) in plain torch."""

    def __init__(
        self,
        *,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ) -> None:
        super().__init__()
        self.config = config
        self.te_forward_mask_type = True  # TE >= 0.12: the mask type is passed per call
        self.qkv_format = "sbhd"
        self.attn_mask_type = attn_mask_type.name  # TE's default when none is passed
        self.softmax_scale = softmax_scale or config.kv_channels**-0.5
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.calls: list[AttentionCall] = []

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
        num_splits: int | None = None,
    ) -> torch.Tensor:
        """``[sq, b, np, d]`` queries against ``[sk, b, ng, d]`` keys -> ``[sq, b, np*d]``."""
        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("the TE attention stand-in models neither bias nor packing")
        mask_type = attn_mask_type.name if attn_mask_type is not None else self.attn_mask_type
        self.calls.append(
            AttentionCall(mask_type, query.shape[0], key.shape[0], attention_mask is not None)
        )
        probs = te_attention_probs(
            query, key, attention_mask, mask_type, softmax_scale=self.softmax_scale
        )
        fork = contextlib.nullcontext() if self.config.sequence_parallel else None
        with fork or get_cuda_rng_tracker().fork():
            probs = F.dropout(probs, self.dropout, self.training)
        return attention_context(probs, value)


def stand_in_attentions(model: torch.nn.Module) -> list[StandInTEDotProductAttention]:
    return [m for m in model.modules() if isinstance(m, StandInTEDotProductAttention)]


def take_calls(stand_ins: list) -> list[list]:
    """Each stand-in's ``calls`` logged since the last take, which starts the log afresh
    (``observe`` of :func:`~megatron_domino.analysis.equivalence.compare_with_stock`)."""
    taken = [stand_in.calls[:] for stand_in in stand_ins]
    for stand_in in stand_ins:
        stand_in.calls.clear()
    return taken
