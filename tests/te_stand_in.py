"""CPU stand-ins for Megatron-Core's Transformer Engine linears, keeping the contract Domino uses.

Transformer Engine needs CUDA, so the CPU tests cannot build ``TERowParallelLinear`` or
``TELayerNormColumnParallelLinear``. These stand-ins reuse Megatron's local linears for the
weights (same shapes, initialisation and TP attributes) and reproduce, in plain torch, what
:mod:`megatron_domino.te_linears` relies on in the real ones (read from TE's source, 1.13 and
2.x, and Megatron-Core 0.19's wrappers in ``megatron/core/extensions/transformer_engine.py``):

* the collectives are chosen on every call from ``parallel_mode`` and ``sequence_parallel``:
  row: all-reduce the output (reduce-scatter under SP); column: forward copy with a backward
  all-reduce of the input gradient (under SP: all-gather the norm output, backward
  reduce-scatter). With ``parallel_mode=None`` there is none;
* the column linear normalises its input itself (the layer's own norm is ``IdentityOp``);
  under SP it normalises the sequence shard and then gathers, and its norm parameters are
  marked ``sequence_parallel`` (so ``finalize_model_grads`` sums their gradients over TP);
* ``te_return_bias`` (the bias is returned, not added) and ``use_bias``;
* Megatron's wrapper passes ``is_first_microbatch`` (``None`` when
  ``disable_parameter_transpose_cache``) and then sets it to False. The stand-ins record what
  they were passed, and whether a ``fp8_autocast`` stand-in (:data:`FP8_CONTEXT_DEPTH`) was
  open, in ``calls``.

What they do not model: FP8 arithmetic, TE's fused kernels, Userbuffers, and the per-module
quantization context 0.19's wrappers enter around each call (only with ``quant_recipe``, which
Domino refuses).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_domino.norms import SequenceParallelTorchNorm

#: How many fp8_autocast stand-ins are open (see ``tests/test_te_linears.py``).
FP8_CONTEXT_DEPTH = [0]


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

    def _start_call(self) -> None:
        first = None if self.disable_parameter_transpose_cache else self.is_first_microbatch
        self.calls.append(
            Call(self.parallel_mode, self.sequence_parallel, first, FP8_CONTEXT_DEPTH[0] > 0)
        )
        self.is_first_microbatch = False

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
        self._start_call()
        output = F.linear(input_, self.weight)
        if self.parallel_mode == "row" and self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(output, group=self.tp_group)
        elif self.parallel_mode == "row":
            output = reduce_from_tensor_model_parallel_region(output, group=self.tp_group)
        if self.use_bias and not self.te_return_bias:
            output = output + self.bias
        return self._outputs(output)


class StandInTELayerNormColumnParallelLinear(_TEWrapperContract, ColumnParallelLinear):
    """``TELayerNormColumnParallelLinear``'s contract: norm fused before the column GEMM."""

    def __init__(self, input_size, output_size, *, config, bias, skip_bias_add, **kwargs):
        super().__init__(
            input_size, output_size, config=config, bias=bias, skip_bias_add=True, **kwargs
        )
        self._init_te("column", config, bias, skip_bias_add)
        self.norm = SequenceParallelTorchNorm(config, input_size, eps=config.layernorm_epsilon)

    def forward(self, input_: torch.Tensor):
        """``[s or s/tp, b, h]`` -> ``([s, b, n/tp], bias-or-None)``."""
        self._start_call()
        normed = self.norm(input_)
        if self.parallel_mode == "column" and self.sequence_parallel:
            normed = gather_from_sequence_parallel_region(normed, group=self.tp_group)
        elif self.parallel_mode == "column":
            normed = copy_to_tensor_model_parallel_region(normed, group=self.tp_group)
        bias = None if self.te_return_bias or not self.use_bias else self.bias
        return self._outputs(F.linear(normed, self.weight, bias))


class StandInTESpecProvider(LocalSpecProvider):
    """Megatron's ``TESpecProvider`` for the dense layer: the stand-in linears, norms fused
    into the column-parallel ones, and Megatron's local attention (TE's needs CUDA)."""

    def row_parallel_linear(self) -> type:
        return StandInTERowParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        return True

    def column_parallel_layer_norm_linear(self) -> type:
        return StandInTELayerNormColumnParallelLinear


def stand_in_te_layer_spec() -> ModuleSpec:
    """The dense layer of Megatron's TE spec (``get_gpt_layer_with_transformer_engine_spec``),
    shape for shape, built from :class:`StandInTESpecProvider`: the layer's own norms are
    ``IdentityOp`` (the fused norms follow ``config.normalization``, as TE's do), and the MLP
    is a ``functools.partial`` of ``MLP.as_mlp_submodule`` whose fc1 has the norm fused in.
    """
    backend = StandInTESpecProvider()
    attention = ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=backend.column_parallel_layer_norm_linear(),
            core_attention=backend.core_attention(),
            linear_proj=backend.row_parallel_linear(),
            q_layernorm=IdentityOp,
            k_layernorm=IdentityOp,
        ),
    )
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
