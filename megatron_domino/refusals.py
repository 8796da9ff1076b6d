"""Everything Domino refuses to run with, and why: one module, so a reader finds every rule.

If the user asked for Domino and it cannot run, it raises
:class:`~megatron_domino.base.config.DominoUnsupportedError` listing every reason with its fix;
it never falls back to the stock path silently (an A/B comparison would become baseline vs
baseline). The rules come in three levels, each a function returning the reasons:

* :func:`config_problems`: what a ``TransformerConfig`` and the TP size say (the attributes
  :data:`~megatron_domino.refusal_table.REFUSALS` names, recompute, the shapes, Transformer
  Engine settings). It needs no
  model, so the training script runs it on the parsed flags before anything is built
  (:func:`megatron_domino.training.megatron_lm.check_args`, with :func:`fsdp_problems`);
* :func:`model_problems`: the same on a built block, plus what only the built modules show:
  FSDP-wrapped layers (:func:`sharded_problems`, checked again at each forward), and every
  target of :data:`megatron_domino.plan.LAYER_PLAN` being a module Domino knows
  (:func:`layer_problems`); :func:`megatron_domino.apply.apply_domino` runs it;
* :func:`raise_problems` turns reasons into the one error.

It is longer than the other modules because it is the complete list, kept together on purpose.
Each refusal is also a row of the README's support table,
:data:`~megatron_domino.refusal_table.REFUSALS`.
"""

from __future__ import annotations

import torch
from megatron.core.enums import Fp8Recipe
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType, LayerType
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from megatron_domino.base.config import DominoConfig, DominoUnsupportedError
from megatron_domino.base.version import check_transformer_engine_version
from megatron_domino.communication.te_quantizers import quantizer_role_problems
from megatron_domino.plan import (
    LAYER_PLAN,
    LAYER_SUBLAYERS,
    LINEARS,
    Target,
    block_layer_kinds,
    is_te_core_attention,
    is_te_linear,
    targets_of,
)
from megatron_domino.refusal_table import HYBRID_LAYERS, config_refusals
from megatron_domino.specs.te_spec import TENormsApartLayer, TENormsApartMLPLayer

__all__ = [
    "config_problems",
    "fsdp_problems",
    "layer_problems",
    "model_problems",
    "pipeline_stage_problems",
    "raise_problems",
    "recompute_problems",
    "sharded_problems",
    "te_problems",
    "te_sequence_parallel_problems",
]


def recompute_problems(granularity: str | None, modules, *, fp8: bool) -> list[str]:
    """Why Domino cannot run with this activation recompute (empty when it can).

    Selective recompute of ``core_attn`` runs inside Megatron's ``SelfAttention``, which the
    schedule calls per chunk, so each chunk's core attention is checkpointed on its own (no
    collective inside). Full recompute checkpoints ranges of layers, each run as one Domino
    step (:func:`megatron_domino.engine.block.layer_groups`). Recompute of the norms or the MLP wraps
    code that Domino re-sequences; full recompute with FP8 needs TE's own checkpoint.
    """
    if granularity == "full" and fp8:
        return [
            "full activation recompute with FP8 needs Transformer Engine's checkpoint, which "
            "Domino does not use; use --recompute-granularity selective or drop --fp8-format"
        ]
    unsupported = sorted(set(modules) - {"core_attn"}) if granularity == "selective" else []
    if unsupported:
        return [
            f"selective recompute of {', '.join(unsupported)} is not supported (Domino calls "
            "the norms and the MLP itself); use --recompute-modules core_attn"
        ]
    return []


def fsdp_problems(*, megatron_fsdp: bool, torch_fsdp2: bool) -> list[str]:
    """Why Domino cannot run under fully sharded data parallelism (empty without it).

    Megatron-FSDP (``--use-megatron-fsdp``) and PyTorch FSDP2 (``--use-torch-fsdp2``) shard
    each ``TransformerLayer``'s parameters and gather them in hooks on that module: a forward
    pre-hook before its forward, a post-hook that frees them after it, and a hook on its
    outputs that gathers them again for backward. Domino never calls the layer module: it
    runs the layer's submodules itself, chunk by chunk and across layer boundaries, so those
    hooks would not fire and the layers would compute with sharded parameters (under FSDP2 the
    first norm fails on a DTensor). Supporting it means gathering each layer for the whole
    span its chunks run in, forward and backward; not done.
    """
    wrappers = (("--use-megatron-fsdp", megatron_fsdp), ("--use-torch-fsdp2", torch_fsdp2))
    flags = [flag for flag, on in wrappers if on]
    if not flags:
        return []
    return [
        f"{' and '.join(flags)}: fully sharded data parallelism gathers each layer's parameters "
        "in hooks on the TransformerLayer module, which Domino never calls (it runs the "
        "layer's submodules itself, chunk by chunk), so the layers would compute with "
        "sharded parameters; use Megatron's DDP (add --use-distributed-optimizer to shard "
        "the optimizer state) or drop --domino"
    ]


def sharded_problems(block: torch.nn.Module) -> list[str]:
    """:func:`fsdp_problems` of a built block whose layers FSDP already wrapped.

    FSDP2's ``fully_shard`` turns each layer into an ``FSDPModule`` with DTensor parameters;
    Megatron-FSDP marks every parameter it manages with ``__fsdp_param__`` (and Megatron's
    FSDP2 wrapper with ``is_torch_fsdp2_param``). A layer's first parameter tells.
    """
    megatron_fsdp = torch_fsdp2 = False
    for layer in getattr(block, "layers", ()):
        param = next(layer.parameters(), None)
        megatron_fsdp |= bool(getattr(param, "__fsdp_param__", False))
        torch_fsdp2 |= isinstance(layer, FSDPModule) or isinstance(param, DTensor)
        torch_fsdp2 |= bool(getattr(param, "is_torch_fsdp2_param", False))
    return fsdp_problems(megatron_fsdp=megatron_fsdp, torch_fsdp2=torch_fsdp2)


def config_problems(
    model_config, config: DominoConfig, *, tp_size: int, te_layers: bool
) -> list[str]:
    """Why Domino cannot run with this ``TransformerConfig`` at this TP size (empty if it can).

    Args:
        model_config: Megatron-Core's ``TransformerConfig`` (built from the flags, or the
            built block's).
        config: the Domino settings.
        tp_size: the tensor-parallel size.
        te_layers: whether the layers are Transformer Engine's.
    """
    problems = config_refusals(model_config)
    if tp_size < 2:
        problems.append(
            "tensor-model-parallel size is 1, so there is no tensor-parallel "
            "communication to hide; use --tensor-model-parallel-size >= 2 or drop --domino"
        )
    if model_config.sequence_parallel and not config.backward_overlap:
        problems.append(
            "--no-domino-backward-overlap is not supported with --sequence-parallel (the "
            "sequence-parallel collectives always overlap in backward); drop one of them"
        )
    problems += recompute_problems(
        model_config.recompute_granularity,
        model_config.recompute_modules or (),
        fp8=bool(model_config.fp8),
    )
    problems += config.shape_problems(hidden_size=model_config.hidden_size)
    problems += pipeline_stage_problems(model_config)
    if config.split_along == "sequence":
        problems += _sequence_split_config_problems(model_config)
    if te_layers:
        problems += te_problems(
            config,
            sequence_parallel=model_config.sequence_parallel,
            fp8_recipe=model_config.fp8_recipe if model_config.fp8 else None,
            disable_parameter_transpose_cache=model_config.disable_parameter_transpose_cache,
        )
    elif model_config.fp8:
        problems.append(
            "FP8 runs only in Transformer Engine layers, and this model has Megatron's local "
            "linears; use --transformer-impl transformer_engine or drop --fp8-format"
        )
    return problems


def pipeline_stage_problems(model_config) -> list[str]:
    """Every (virtual) pipeline stage must hold a transformer layer for Domino to chunk.

    Under PP (interleaved or not) Megatron-LM builds one model chunk per virtual stage and
    Domino runs its schedule on each chunk's block. A layout can leave a stage without any
    transformer layer (``--pipeline-model-parallel-layout`` such as ``E|tt|tt|L``, or
    ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``
    with one layer per virtual stage): that block has nothing to split and no TP collective
    to hide, and a Domino run on it would be the stock path under Domino's name. The counts
    are Megatron-Core's own (``get_num_layers_to_build`` per pipeline rank and virtual stage,
    or the layout's table), so this runs on the flags, before any process group exists.
    """
    pipeline = model_config.pipeline_model_parallel_size
    virtual = model_config.virtual_pipeline_model_parallel_size or 1
    layout = model_config.pipeline_model_parallel_layout
    empty = []
    for stage in range(virtual):
        for rank in range(pipeline):
            if layout is not None:
                layers = layout.layout[rank][stage].count(LayerType.decoder)
            else:
                vp_stage = stage if model_config.virtual_pipeline_model_parallel_size else None
                layers = get_num_layers_to_build(model_config, vp_stage=vp_stage, pp_rank=rank)
            if layers == 0:
                empty.append(f"pipeline rank {rank} virtual stage {stage}")
    if not empty:
        return []
    return [
        f"no transformer layer on {', '.join(empty)} (the layout gives it only the embedding "
        "or the loss), so Domino has nothing to chunk there; give every virtual stage at least "
        "one layer (fewer virtual stages, a --pipeline-model-parallel-layout with a 't' in "
        "every stage, or without --account-for-embedding/loss-in-pipeline-split)"
    ]


def _sequence_split_config_problems(model_config) -> list[str]:
    """Under sequence parallelism the sequence split runs on a chunk-major layout
    (:mod:`megatron_domino.engine.chunking`); ``s`` divisible by ``p * TP`` is checked with the shapes."""
    problems = []
    modules = model_config.recompute_modules or ()
    if model_config.recompute_granularity == "selective" and "core_attn" in modules:
        problems.append(
            "--domino-split sequence cannot replay a checkpointed core attention (its keys come "
            "from other chunks); drop the selective recompute or use --domino-split batch"
        )
    return problems


#: The FP8 recipes Domino runs on TE layers: ``delayed`` (scales from the amax history, the
#: same for every chunk), ``tensorwise`` (each cast's own amax, reduced over the TP group
#: where stock reduces it: one scale per chunk instead of stock's one per micro-batch,
#: :mod:`megatron_domino.communication.te_fp8_inputs`) and ``blockwise`` (1 x 128 tiles along ``h`` for
#: activations, so the forward's scales are stock's whatever the chunks).
_FP8_RECIPES_RUN = (Fp8Recipe.delayed.value, Fp8Recipe.tensorwise.value, Fp8Recipe.blockwise.value)
#: Why the others are refused, and what to run instead.
_FP8_RECIPE_REFUSALS = {
    "mxfp8": "--fp8-recipe mxfp8 runs on Blackwell GPUs only (MXFP8 GEMMs; Hopper has none), "
    "and Domino has not been validated with its 1x32 block scales; use --fp8-recipe delayed, "
    "tensorwise or blockwise",
    "other": "--fp8-recipe {recipe} has not been validated with Domino's chunks against stock "
    "Megatron; use --fp8-recipe delayed, tensorwise or blockwise",
}


def te_problems(
    config: DominoConfig,
    *,
    sequence_parallel: bool,
    fp8_recipe: Fp8Recipe | str | None,
    disable_parameter_transpose_cache: bool = False,
) -> list[str]:
    """Why Domino cannot run these settings on TE layers (empty when it can).

    Args:
        config: the Domino settings.
        sequence_parallel: ``--sequence-parallel``.
        fp8_recipe: ``--fp8-recipe`` when FP8 is on (``--fp8-format`` given), else ``None``:
            its name, or Megatron-Core's ``Fp8Recipe`` member (a ``str`` enum, whose ``str()``
            on Python 3.12 is ``Fp8Recipe.delayed``, not the name).
        disable_parameter_transpose_cache: ``--disable-parameter-transpose-cache``.
    """
    problems = []
    if config.column_chunks > 1:
        problems.append(
            "--domino-column-chunks > 1 needs Megatron's local linears (a TE linear multiplies "
            "by its whole weight, so its output cannot be split into pieces); use "
            "--domino-column-chunks 1 with --transformer-impl transformer_engine"
        )
    if not sequence_parallel and config.backward_overlap:
        problems.append(
            "without --sequence-parallel, TE's fused norm + column-parallel linear keeps its "
            "input-gradient all-reduce inside its backward (overlapped with its own "
            "weight-gradient GEMM, as in stock Megatron), so Domino's cross-chunk backward "
            "overlap cannot apply: add --no-domino-backward-overlap, or --sequence-parallel "
            "(under which Domino overlaps the backward collectives too)"
        )
    recipe = _recipe_name(fp8_recipe)
    if recipe is not None and recipe not in _FP8_RECIPES_RUN:
        problems.append(
            _FP8_RECIPE_REFUSALS.get(recipe, _FP8_RECIPE_REFUSALS["other"]).format(recipe=recipe)
        )
    if recipe is not None and disable_parameter_transpose_cache:
        problems.append(
            "--disable-parameter-transpose-cache makes every TE call cast its weight to FP8 "
            "afresh (TE caches no copy, module/linear.py), so each of Domino's chunks would "
            f"cast every weight again: {config.chunks} casts per micro-batch where stock makes "
            "one; drop --disable-parameter-transpose-cache (Domino then casts each weight once "
            "per global batch, as stock)"
        )
    return problems


def _recipe_name(fp8_recipe: Fp8Recipe | str | None) -> str | None:
    """``--fp8-recipe``'s name: Megatron-Core's ``Fp8Recipe`` is a ``str`` enum, whose ``str()``
    on Python 3.12 is ``Fp8Recipe.delayed``, not the name."""
    return getattr(fp8_recipe, "value", fp8_recipe)


#: Why Domino refuses Transformer Engine's fused norm + column linear under sequence
#: parallelism, and the fix (flag time: Megatron-LM would build that layer; model time: it was).
TE_FUSED_NORM_UNDER_SP = (
    "under --sequence-parallel Domino needs Transformer Engine's norms apart from the "
    "column-parallel linears: on the fused TELayerNormColumnParallelLinear it could only "
    "gather the pre-norm residual, so the norm would run tp times and keep the whole "
    "sequence for backward (stock TE norms the shard and gathers the norm output); add "
    "--spec megatron_domino.specs.te_spec te_norms_apart_block_spec (TE's TENorm + "
    "TEColumnParallelLinear: the same parameters, torch_dist checkpoints load either way; "
    "pretrain_gpt_domino.py and the patched pretrain_gpt.py both take it; for a HybridModel, "
    "--spec megatron_domino.specs.te_hybrid_spec te_norms_apart_hybrid_stack_spec), or drop "
    "--sequence-parallel"
)


def te_sequence_parallel_problems(block: torch.nn.Module) -> list[str]:
    """:data:`TE_FUSED_NORM_UNDER_SP` when a sequence-parallel block's TE layers fuse a norm
    into a column linear (the norm of one of the layer's sub-layers is then ``IdentityOp``)."""
    if not block.config.sequence_parallel:
        return []
    fused = any(
        isinstance(_sublayer_norm(layer, sublayer), IdentityOp)
        for layer, kind in zip(block.layers, block_layer_kinds(block), strict=True)
        for sublayer in LAYER_SUBLAYERS.get(kind, ())
    )
    return [TE_FUSED_NORM_UNDER_SP] if fused else []


def _sublayer_norm(layer: torch.nn.Module, sublayer: str) -> torch.nn.Module:
    """The norm before ``sublayer`` in ``layer``."""
    return layer.input_layernorm if sublayer == "attention" else layer.pre_mlp_layernorm


def raise_problems(problems: list[str]) -> None:
    """Raise one :class:`DominoUnsupportedError` listing ``problems`` (if there are any)."""
    if problems:
        raise DominoUnsupportedError(
            "Domino cannot run on this model:\n  - " + "\n  - ".join(dict.fromkeys(problems))
        )


def model_problems(block: torch.nn.Module, config: DominoConfig) -> list[str]:
    """Every reason Domino cannot run on this built layer stack (a ``TransformerBlock`` or a
    ``HybridStack``; empty when it can).

    Raises:
        DominoUnsupportedError: the installed Transformer Engine is too old for TE layers.
    """
    tp_size = block.tp_group.size()
    kinds = block_layer_kinds(block)
    linears = [
        t.find(layer)
        for layer, kind in zip(block.layers, kinds, strict=True)
        for t in targets_of(LAYER_SUBLAYERS.get(kind, ()))
        if t in LINEARS
    ]
    te_layers = any(is_te_linear(module) for module in linears if module is not None)
    if te_layers:
        check_transformer_engine_version()
    problems = config_problems(block.config, config, tp_size=tp_size, te_layers=te_layers)
    if te_layers:
        problems += te_sequence_parallel_problems(block)
    fp8 = block.config.fp8 and block.config.sequence_parallel
    if te_layers and fp8 and _recipe_name(block.config.fp8_recipe) in _FP8_RECIPES_RUN:
        # Domino's gathered FP8 casts read TE's quantizers by position: one probe per class
        # (of a recipe Domino runs: another one is refused above, and TE may not enter it here).
        classes = {type(m): m for m in linears if m is not None and is_te_linear(m)}
        for linear in classes.values():
            problems += quantizer_role_problems(linear, block.config)
    problems += sharded_problems(block)
    if not block.layers:
        problems.append("the block has no layers")
    refused = sorted({kind for kind in kinds if kind not in LAYER_SUBLAYERS})
    if refused:
        problems.append(
            f"HybridModel layers {', '.join(map(repr, refused))}: {HYBRID_LAYERS.message}"
        )
    if getattr(block, "is_mtp_layer", False):
        problems.append(f"a HybridModel MTP stack: {HYBRID_LAYERS.message}")
    if config.split_along == "sequence":
        problems += _sequence_split_problems(block)
    for index, (layer, kind) in enumerate(zip(block.layers, kinds, strict=True)):
        if kind in LAYER_SUBLAYERS:
            problems += [
                f"layer {index}: {p}" for p in layer_problems(layer, LAYER_SUBLAYERS[kind])
            ]
    return problems


def _sequence_split_problems(block: torch.nn.Module) -> list[str]:
    """What the sequence split needs of the built layers' attention: token ranges of a causal
    sequence, attended by Megatron-Core's local attention or Transformer Engine's, each given a
    chunk's queries against more keys (see :mod:`megatron_domino.engine.chunk_attention`; the
    config-level needs are in :func:`config_problems`)."""
    problems = []
    for index, (layer, kind) in enumerate(zip(block.layers, block_layer_kinds(block), strict=True)):
        if "attention" not in LAYER_SUBLAYERS.get(kind, ()):
            continue
        attention = getattr(layer, "self_attention", None)
        core = _CORE_ATTENTION.find(layer)
        te = is_te_core_attention(core)
        if not te and type(core).forward is not _CORE_ATTENTION.stock.forward:
            problems.append(
                f"layer {index}: --domino-split sequence needs Megatron-Core's local "
                f"DotProductAttention or Transformer Engine's, not {type(core).__name__}"
            )
        elif te and not (core.te_forward_mask_type and core.qkv_format == "sbhd"):
            problems.append(
                f"layer {index}: --domino-split sequence needs Transformer Engine's attention "
                "to take the mask type per call (TE >= 0.12) in the sbhd layout (no packed "
                "sequences), to give later chunks a bottom-right causal mask"
            )
        elif attention.attn_mask_type != AttnMaskType.causal:
            problems.append(
                f"layer {index}: --domino-split sequence needs causal attention, not "
                f"{attention.attn_mask_type.name}"
            )
    return problems


#: The layer classes Domino runs: Megatron-Core's dense layer, its TE norms-apart variant, and
#: HybridModel's MLP-only layer (a ``TransformerLayer`` whose attention is the identity) and its
#: TE norms-apart variant.
_LAYER_CLASSES = (TransformerLayer, TENormsApartLayer, MLPLayer, TENormsApartMLPLayer)


def layer_problems(
    layer: torch.nn.Module, sublayers: tuple[str, ...] = LAYER_SUBLAYERS["transformer"]
) -> list[str]:
    """Structural checks of a layer with ``sublayers``: Domino calls their submodules itself,
    so they must be the stock ones
    (:class:`~megatron_domino.specs.te_spec.TENormsApartLayer` differs from Megatron's only in how it
    saves and loads checkpoints), and a sub-layer the layer lacks must be Megatron's identity."""
    if type(layer) not in _LAYER_CLASSES or layer.is_moe_layer:
        return [f"{type(layer).__name__} is not a dense Megatron-Core TransformerLayer"]
    modules = {"attention": (layer.self_attention, SelfAttention), "mlp": (layer.mlp, MLP)}
    problems = [
        f"its {sublayer} is {type(module).__name__}, where Domino runs no {sublayer} (the "
        "hybrid layer pattern names which sub-layers a layer has)"
        for sublayer, (module, _) in modules.items()
        if sublayer not in sublayers and not isinstance(module, IdentityOp)
    ]
    present = [
        (module, stock) for sublayer, (module, stock) in modules.items() if sublayer in sublayers
    ]
    if any(type(module).forward is not stock.forward for module, stock in present):
        problems.append(
            f"{' / '.join(type(module).__name__ for module, _ in present)}: the schedule runs "
            "Megatron-Core's SelfAttention and MLP forward (a fused variant such as TE's fused "
            "MLP runs fc1 and fc2 as one op); use the standard layer spec"
        )
        return problems
    linears = {target: target.find(layer) for target in targets_of(sublayers) if target in LINEARS}
    missing = sorted(target.name for target, module in linears.items() if module is None)
    if missing:
        problems.append(f"missing tensor-parallel linears: {missing}")
    for target, module in linears.items():
        if module is not None:
            problems += _linear_problems(target, module)
    if not isinstance(layer.cross_attention, IdentityOp) or not isinstance(
        layer.pre_cross_attn_layernorm, IdentityOp
    ):
        problems.append("cross-attention is not supported")
    if not isinstance(layer.cross_attn_bda, IdentityFuncOp):
        problems.append("cross-attention bias-dropout-add is not supported")
    if layer.recompute_input_layernorm or layer.recompute_pre_mlp_layernorm or layer.recompute_mlp:
        problems.append("selective recompute of layernorm or mlp is not supported")
    if (
        layer.offload_attn_norm
        or layer.offload_mlp_norm
        or getattr(layer.self_attention, "offload_attn_proj", False)
    ):
        problems.append("activation offloading is not supported")
    return problems


def _linear_problems(target: Target, module: torch.nn.Module) -> list[str]:
    """Domino calls this linear itself: it must be Megatron's own or a TE one it knows."""
    name, mode, local_class = target.name, target.kind, target.stock
    if is_te_linear(module):
        if module.parallel_mode != mode:
            return [
                f"{name} is a Transformer Engine linear in {module.parallel_mode!r} mode, "
                f"not {mode!r}"
            ]
        if mode == "row" and module.use_bias and not module.te_return_bias:
            return [f"{name} adds its bias before the reduction; build it with skip_bias_add"]
        return []
    if type(module).forward is not local_class.forward:
        return [
            f"{name} is {type(module).__name__}, neither Megatron-Core's "
            f"{local_class.__name__} nor a Transformer Engine linear"
        ]
    if mode == "column" and (
        module.gather_output or not (module.sequence_parallel or module.allreduce_dgrad)
    ):
        return [f"{name} must be a plain column-parallel linear (no gather_output)"]
    return []


#: The plan's core-attention target (bound under the sequence split only).
_CORE_ATTENTION = next(t for t in LAYER_PLAN if t.kind == "core_attention")
