"""What Domino binds onto a model: one table, read by :mod:`.apply` and by :mod:`.refusals`.

Domino replaces the ``forward`` of a few module *instances* of a Megatron-Core ``GPTModel`` or
``HybridModel``: its layer stack (the ``TransformerBlock``, or the ``HybridStack``;
:func:`megatron_domino.engine.block.domino_block_forward`) and, in every layer, the modules of
:data:`LAYER_PLAN` of the layer's sub-layers (:data:`LAYER_SUBLAYERS`: which layer gives which
ops; the schedule runs three per sub-layer). Each entry names the module by its attribute path
from the ``TransformerLayer``, its kind, and the Megatron-Core class whose ``forward`` the
stock layer would run there. :func:`layer_forward` picks Domino's forward for the module found
at a target: it is the one place that tells a Transformer Engine module from Megatron's own
(TE's classes exist only where TE imports, so its modules are recognised by interface,
:func:`is_te_linear` and :func:`is_te_core_attention`). :func:`megatron_domino.apply.apply_domino`
binds what it returns; :mod:`megatron_domino.refusals` checks, from the same table, that every
target is there and is a module Domino knows.

=================================  ==============  =======================================
target                             kind            Domino's forward (local / TE)
=================================  ==============  =======================================
``self_attention.linear_qkv``      column          :func:`.linears.column_parallel_forward`
                                                   (with backward overlap) /
                                                   :func:`.te_linears.te_column_parallel_forward`
``self_attention.core_attention``  core_attention  under the sequence split only:
                                                   :func:`.chunk_attention.core_attention_forward`
``self_attention.linear_proj``     row             :func:`.linears.capture_row_input` with
                                                   :data:`.row_output.LOCAL_ROW` / :data:`.te_linears.TE_ROW`
``mlp.linear_fc1``                 column          as ``linear_qkv``
``mlp.linear_fc2``                 row             as ``linear_proj``
=================================  ==============  =======================================

At the model's two ends (:data:`MODEL_ENDS`, on the ``GPTModel`` or ``HybridModel`` of a pipeline
stage, where its check finds nothing against it): ``embedding``
(:func:`.embedding_overlap.embedding_forward`) and, with backward overlap, ``output_layer``
(:func:`.output_head.output_layer_forward`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_domino.base.config import DominoConfig
from megatron_domino.engine.chunk_attention import core_attention_forward, local_attend, te_attend
from megatron_domino.engine.embedding_overlap import embedding_forward, embedding_problems
from megatron_domino.engine.linears import capture_row_input, column_parallel_forward
from megatron_domino.engine.output_head import output_layer_forward, output_layer_problems
from megatron_domino.engine.row_output import LOCAL_ROW
from megatron_domino.engine.te_linears import TE_ROW, te_column_parallel_forward

__all__ = [
    "LAYER_PLAN",
    "LAYER_SUBLAYERS",
    "LINEARS",
    "MODEL_ENDS",
    "ModelEnd",
    "Target",
    "block_layer_kinds",
    "is_te_core_attention",
    "is_te_linear",
    "layer_forward",
    "model_end_forwards",
    "targets_of",
]


@dataclass(frozen=True)
class Target:
    """A module of every ``TransformerLayer`` whose ``forward`` Domino may replace.

    Attributes:
        path: attribute path from the layer, e.g. ``self_attention.linear_proj``.
        kind: ``column`` or ``row`` (a tensor-parallel linear; TE's ``parallel_mode`` says the
            same), or ``core_attention``.
        stock: the Megatron-Core class (local layer spec) whose forward the layer would run.
    """

    path: str
    kind: Literal["column", "row", "core_attention"]
    stock: type

    @property
    def sublayer(self) -> str:
        """The sub-layer the module belongs to (``attention``, ``mlp``)."""
        return "attention" if self.path.startswith("self_attention.") else "mlp"

    @property
    def name(self) -> str:
        """The attribute's own name (``linear_proj``)."""
        return self.path.rsplit(".", 1)[-1]

    def find(self, layer: torch.nn.Module) -> torch.nn.Module | None:
        """The module at :attr:`path` in ``layer``, or ``None`` where the layer has none."""
        module = layer
        for part in self.path.split("."):
            module = getattr(module, part, None)
        return module


#: Every module Domino binds in a layer, in the order the layer runs them.
LAYER_PLAN: tuple[Target, ...] = (
    Target("self_attention.linear_qkv", "column", ColumnParallelLinear),
    Target("self_attention.core_attention", "core_attention", DotProductAttention),
    Target("self_attention.linear_proj", "row", RowParallelLinear),
    Target("mlp.linear_fc1", "column", ColumnParallelLinear),
    Target("mlp.linear_fc2", "row", RowParallelLinear),
)
#: The layer's four tensor-parallel linears.
LINEARS: tuple[Target, ...] = tuple(t for t in LAYER_PLAN if t.kind in ("column", "row"))

#: Which layer gives which ops: per kind of layer, its sub-layers in order, each run as three
#: ops (norm, core, projection; :mod:`megatron_domino.engine.schedule`). ``GPTModel``'s
#: ``TransformerLayer`` has both; a ``HybridModel``'s layers are named by their symbol in
#: ``--hybrid-layer-pattern``: ``*`` a ``TransformerLayer`` with self-attention only, ``-`` an
#: ``MLPLayer`` (the MLP only). Other symbols are refused
#: (:data:`megatron_domino.refusal_table.HYBRID_LAYERS`).
LAYER_SUBLAYERS: dict[str, tuple[str, ...]] = {
    "transformer": ("attention", "mlp"),
    "*": ("attention",),
    "-": ("mlp",),
}


def block_layer_kinds(block: torch.nn.Module) -> list[str]:
    """The kind of each layer of ``block`` (a ``TransformerBlock``: ``transformer``; a
    ``HybridStack``: its layers' pattern symbols, this pipeline segment's)."""
    symbols = getattr(block, "layer_type_list", None)
    return list(symbols) if symbols is not None else ["transformer"] * len(block.layers)


def targets_of(sublayers: tuple[str, ...]) -> tuple[Target, ...]:
    """The targets of :data:`LAYER_PLAN` a layer with ``sublayers`` has."""
    return tuple(t for t in LAYER_PLAN if t.sublayer in sublayers)


def is_te_linear(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a TE tensor-parallel linear as Megatron-Core wraps it.

    Recognised by interface, not class: TE's ``parallel_mode`` and the ``te_return_bias`` of
    Megatron's wrappers (``megatron.core.extensions.transformer_engine``).
    """
    return hasattr(module, "parallel_mode") and hasattr(module, "te_return_bias")


def is_te_core_attention(module: torch.nn.Module) -> bool:
    """Whether ``module`` is Transformer Engine's attention as Megatron-Core wraps it.

    Recognised by interface (``TEDotProductAttention``): the wrapper's
    ``te_forward_mask_type`` (whether it passes the mask type to TE per call) and
    ``qkv_format``.
    """
    return hasattr(module, "te_forward_mask_type") and hasattr(module, "qkv_format")


def layer_forward(target: Target, module: torch.nn.Module, config: DominoConfig) -> Callable | None:
    """Domino's forward for ``module`` at ``target``, or ``None`` where the stock one serves.

    The result takes ``module`` first and the model's runtime as ``runtime=``. A local
    column-parallel linear needs Domino's forward for backward overlap (which sequence
    parallelism requires); a TE one always does: under sequence parallelism it takes over the
    all-gather, and in every case it keeps the chunks' weight gradients accumulating
    (:mod:`megatron_domino.engine.te_linears`). The core attention is Domino's under the sequence
    split only.
    """
    if target.kind == "row":
        return functools.partial(
            capture_row_input, gemm=TE_ROW if is_te_linear(module) else LOCAL_ROW
        )
    if target.kind == "column":
        if is_te_linear(module):
            return te_column_parallel_forward
        return column_parallel_forward if config.backward_overlap else None
    if config.split_along != "sequence":
        return None
    attend = te_attend if is_te_core_attention(module) else local_attend
    return functools.partial(core_attention_forward, attend=attend)


@dataclass(frozen=True)
class ModelEnd:
    """A module of the language model (``GPTModel``, ``HybridModel``) outside the layer stack whose
    collective Domino may take over.

    Attributes:
        attribute: the model's attribute (``embedding``, ``output_layer``).
        forward: Domino's forward (takes the module first and the runtime as ``runtime=``).
        problems: ``(model, chunks) -> reasons`` it cannot (empty when it can).
        backward: it overlaps a backward collective, so it follows ``backward_overlap``.
    """

    attribute: str
    forward: Callable
    problems: Callable[[torch.nn.Module, int], list[str]]
    backward: bool


#: The model's two ends (module docstring).
MODEL_ENDS: tuple[ModelEnd, ...] = (
    ModelEnd("embedding", embedding_forward, embedding_problems, backward=False),
    ModelEnd("output_layer", output_layer_forward, output_layer_problems, backward=True),
)


def model_end_forwards(
    model: torch.nn.Module, config: DominoConfig
) -> list[tuple[ModelEnd, torch.nn.Module]]:
    """The ends of ``model`` (a ``GPTModel``) Domino binds under ``config``, with their modules."""
    return [
        (end, getattr(model, end.attribute))
        for end in MODEL_ENDS
        if (config.backward_overlap or not end.backward) and not end.problems(model, config.chunks)
    ]
