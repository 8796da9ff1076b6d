"""Apply Domino to a Megatron-Core GPT model, and take it off again.

``apply_domino(model, config)`` binds Domino's ``forward`` onto *instances* of the model's
transformer block, of its layers' tensor-parallel linears and, under the sequence split, of
their core attentions. The classes stay untouched, so an unpatched model in the same process
(e.g. the baseline of an A/B test) is unaffected. No parameter is created or replaced: the schedule calls the model's own submodules. The returned
:class:`DominoHandle` reverts exactly what was bound; applying twice raises, as does reverting
twice. Everything Domino cannot run with is refused here, before the first step, with the
reason and the fix (FSDP wrapping the layers after ``apply_domino``: at the first forward): a
silent fallback would turn an A/B comparison into baseline vs baseline.
"""

from __future__ import annotations

import functools

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from megatron_domino.block import domino_block_forward
from megatron_domino.config import DominoConfig, DominoUnsupportedError
from megatron_domino.linears import column_parallel_forward, row_parallel_forward
from megatron_domino.recorder import NULL_RECORDER, NullRecorder
from megatron_domino.sequence_split import core_attention_forward, is_te_core_attention
from megatron_domino.state import DominoRuntime
from megatron_domino.te_linears import (
    check_transformer_engine_version,
    is_te_linear,
    te_column_parallel_forward,
    te_problems,
)
from megatron_domino.version import check_megatron_core_version

#: (TransformerConfig attribute, is-refused predicate, reason and fix)
_REFUSED_FEATURES = (
    (
        "tp_comm_overlap",
        bool,
        "TE userbuffer overlap (tp_comm_overlap) takes over the same collectives; use one or the other",
    ),
    ("enable_cuda_graph", bool, "CUDA graphs bypass forward(); disable CUDA graphs"),
    ("external_cuda_graph", bool, "CUDA graphs bypass forward(); disable CUDA graphs"),
    (
        "cuda_graph_impl",
        lambda v: v not in (None, "none"),
        "CUDA graphs bypass forward(); set cuda_graph_impl='none'",
    ),
    ("num_moe_experts", lambda v: v is not None, "MoE layers are not supported; use a dense model"),
    (
        "overlap_moe_expert_parallel_comm",
        bool,
        "MoE combined-1F1B overlap takes over the same layers; disable it",
    ),
    ("fp4", lambda v: v is not None, "FP4 is not supported; use FP8 (--fp8-format) or bf16"),
    (
        "first_last_layers_bf16",
        bool,
        "bf16 first/last layers enter an FP8 context per layer, which the chunked schedule "
        "interleaves across layers; drop --first-last-layers-bf16",
    ),
    (
        "symmetric_ar_type",
        lambda v: v is not None,
        "symmetric all-reduce replaces the collective Domino launches itself; drop "
        "--symmetric-ar-type",
    ),
    ("cpu_offloading", bool, "activation CPU offloading is not supported; disable it"),
    (
        "fine_grained_activation_offloading",
        bool,
        "activation offloading is not supported; disable it",
    ),
    (
        "context_parallel_size",
        lambda v: (v or 1) > 1,
        "context parallelism is not supported; use size 1",
    ),
    ("delay_wgrad_compute", bool, "delayed weight-gradient compute is not supported; disable it"),
    (
        "multi_latent_attention",
        bool,
        "multi-latent attention is not supported; use standard attention",
    ),
    (
        "experimental_attention_variant",
        lambda v: v is not None,
        "experimental attention variants are not supported",
    ),
    ("inference_fuse_tp_communication", bool, "fused inference TP communication is not supported"),
    (
        "gtp_weight_remat_size",
        lambda v: (v or 1) > 1,
        "GTP weight sharding (--tensor-parallel-num-weight-shards above the TP size) gathers "
        "each weight inside Megatron-Core's GEMM path, which Domino's chunked GEMMs replace; "
        "drop --tensor-parallel-num-weight-shards",
    ),
    (
        "quant_recipe",
        lambda v: v is not None,
        "per-module quantization recipes (--te-precision-config-file, Kitchen) enter a "
        "quantization context in every linear call, i.e. once per chunk; drop them",
    ),
    (
        "mlp_chunks_for_training",
        lambda v: (v or 1) > 1,
        "mlp_chunks_for_training splits the MLP inside the stock layer forward, which the "
        "Domino schedule replaces; leave it at 1",
    ),
)


def recompute_problems(granularity: str | None, modules, *, fp8: bool) -> list[str]:
    """Why Domino cannot run with this activation recompute (empty when it can).

    Selective recompute of ``core_attn`` runs inside Megatron's ``SelfAttention``, which the
    schedule calls per chunk, so each chunk's core attention is checkpointed on its own (no
    collective inside). Full recompute checkpoints ranges of layers, each run as one Domino
    step (:func:`megatron_domino.block.layer_groups`). Recompute of the norms or the MLP wraps
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


def _block_forward(block: TransformerBlock, *args, runtime: DominoRuntime, **kwargs):
    """Domino's block forward, refusing layers FSDP wrapped after :func:`apply_domino` (a
    library user may apply Domino first; FSDP's hooks on the layers would never run)."""
    raise_problems(sharded_problems(block))
    return domino_block_forward(block, *args, runtime=runtime, **kwargs)


class DominoHandle:
    """What ``apply_domino`` bound, so it can be reverted; also a context manager.

    Attributes:
        runtime: the model's :class:`~megatron_domino.state.DominoRuntime` (its ``last_step``
            and ``recorder`` are what tests and the overlap report read).
    """

    def __init__(self, runtime: DominoRuntime, patched: list[torch.nn.Module]) -> None:
        self.runtime = runtime
        self._patched = patched

    @property
    def active(self) -> bool:
        return bool(self._patched)

    def revert(self) -> None:
        """Restore every patched module's stock ``forward``."""
        if not self._patched:
            raise RuntimeError("Domino was already reverted on this model.")
        for module in self._patched:
            del module.forward
        self._patched = []

    def __enter__(self) -> DominoHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.revert()


def apply_domino(
    model: torch.nn.Module, config: DominoConfig, *, recorder: NullRecorder = NULL_RECORDER
) -> DominoHandle:
    """Make ``model``'s transformer block run the Domino schedule.

    Args:
        model: a Megatron-Core ``GPTModel`` (one pipeline stage or virtual-stage chunk of
            it) built from the local or the Transformer Engine layer spec, bare or wrapped
            (DDP, Float16Module): its single ``TransformerBlock`` is found by type.
        config: the Domino settings.
        recorder: an :class:`~megatron_domino.recorder.EventRecorder` to record the schedule.
    Raises:
        DominoUnsupportedError: for any model feature Domino cannot run with (see the message).
        UnsupportedMegatronVersion: outside the tested Megatron-Core releases.
    """
    check_megatron_core_version()
    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    if len(blocks) != 1:
        raise DominoUnsupportedError(
            f"Domino expects exactly one TransformerBlock in the model, found {len(blocks)}."
        )
    block = blocks[0]
    if "forward" in vars(block):
        raise RuntimeError(
            "Domino is already applied to this model; revert the first handle "
            "before applying again."
        )
    _refuse_unsupported(block, config)

    tp_group = block.layers[0].self_attention.linear_proj.tp_group
    runtime = DominoRuntime(config, tp_group, recorder, block.config.sequence_parallel)
    patched = [block]
    block.forward = functools.partial(_block_forward, block, runtime=runtime)
    for layer in block.layers:
        for linear in (layer.self_attention.linear_proj, layer.mlp.linear_fc2):
            linear.forward = functools.partial(row_parallel_forward, linear, runtime=runtime)
            patched.append(linear)
        for linear in (layer.self_attention.linear_qkv, layer.mlp.linear_fc1):
            forward = _column_forward(linear, runtime)
            if forward is not None:
                linear.forward = functools.partial(forward, linear, runtime=runtime)
                patched.append(linear)
        if config.split_along == "sequence":
            attention = layer.self_attention.core_attention
            attention.forward = functools.partial(
                core_attention_forward, attention, runtime=runtime
            )
            patched.append(attention)
    return DominoHandle(runtime, patched)


def _column_forward(linear: torch.nn.Module, runtime: DominoRuntime):
    """Domino's forward for a column-parallel linear, or ``None`` where the stock one serves.

    Megatron's linear needs Domino's forward for backward overlap (always on under sequence
    parallelism). A TE linear always does: under sequence parallelism it takes over the
    all-gather, and in every case it keeps the chunks' weight gradients accumulating (see
    :mod:`megatron_domino.te_linears`).
    """
    if is_te_linear(linear):
        return te_column_parallel_forward
    return column_parallel_forward if runtime.config.backward_overlap else None


def config_problems(model_config, config: DominoConfig, *, tp_size: int) -> list[str]:
    """Why Domino cannot run with this ``TransformerConfig`` at this TP size (empty if it can).

    These checks need no model, so a training script runs them on its parsed flags, before
    anything is built or written; :func:`apply_domino` runs them again on the built model.
    """
    problems = [
        reason
        for name, refused, reason in _REFUSED_FEATURES
        if refused(getattr(model_config, name, None))
    ]
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
    if model_config.hidden_size % config.column_chunks:
        problems.append(
            f"--hidden-size {model_config.hidden_size} is not divisible by "
            f"--domino-column-chunks {config.column_chunks}"
        )
    if config.split_along == "sequence":
        problems += _sequence_split_config_problems(model_config)
    return problems


def _sequence_split_config_problems(model_config) -> list[str]:
    """Under sequence parallelism the sequence split runs on a chunk-major layout
    (:mod:`megatron_domino.chunking`); ``s`` divisible by ``p * TP`` is checked with the shapes."""
    problems = []
    modules = model_config.recompute_modules or ()
    if model_config.recompute_granularity == "selective" and "core_attn" in modules:
        problems.append(
            "--domino-split sequence cannot replay a checkpointed core attention (its keys come "
            "from other chunks); drop the selective recompute or use --domino-split batch"
        )
    return problems


def raise_problems(problems: list[str]) -> None:
    """Raise one :class:`DominoUnsupportedError` listing ``problems`` (if there are any)."""
    if problems:
        raise DominoUnsupportedError(
            "Domino cannot run on this model:\n  - " + "\n  - ".join(dict.fromkeys(problems))
        )


def _refuse_unsupported(block: TransformerBlock, config: DominoConfig) -> None:
    """Raise one :class:`DominoUnsupportedError` listing every reason Domino cannot run."""
    model_config = block.config
    tp_size = block.layers[0].self_attention.linear_proj.tp_group.size() if block.layers else 1
    problems = config_problems(model_config, config, tp_size=tp_size)
    problems += sharded_problems(block)
    if not block.layers:
        problems.append("the block has no layers")
    linears = [module for layer in block.layers for module in _tp_linears(layer).values()]
    if any(is_te_linear(module) for module in linears):
        check_transformer_engine_version()
        fp8_recipe = model_config.fp8_recipe if model_config.fp8 else None
        problems += te_problems(
            config, sequence_parallel=model_config.sequence_parallel, fp8_recipe=fp8_recipe
        )
    elif model_config.fp8:
        problems.append(
            "FP8 runs only in Transformer Engine layers, and this model has Megatron's local "
            "linears; use --transformer-impl transformer_engine or drop --fp8-format"
        )
    if config.split_along == "sequence":
        problems += _sequence_split_problems(block)
    for index, layer in enumerate(block.layers):
        problems += [f"layer {index}: {p}" for p in _layer_problems(layer)]
    raise_problems(problems)


def _sequence_split_problems(block: TransformerBlock) -> list[str]:
    """What the sequence split needs of the built layers: token ranges of a causal sequence,
    attended by Megatron-Core's local attention or Transformer Engine's, each given a chunk's
    queries against more keys (see :mod:`megatron_domino.sequence_split`; the config-level
    needs are in :func:`config_problems`)."""
    problems = []
    for index, layer in enumerate(block.layers):
        attention = getattr(layer, "self_attention", None)
        core = getattr(attention, "core_attention", None)
        te = is_te_core_attention(core)
        if not te and type(core).forward is not DotProductAttention.forward:
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


def _layer_problems(layer: torch.nn.Module) -> list[str]:
    """Structural checks: Domino calls these submodules itself, so they must be the stock ones."""
    if type(layer) is not TransformerLayer or layer.is_moe_layer:
        return [f"{type(layer).__name__} is not a dense Megatron-Core TransformerLayer"]
    attention, mlp = layer.self_attention, layer.mlp
    problems = []
    if type(attention).forward is not SelfAttention.forward or type(mlp).forward is not MLP.forward:
        problems.append(
            f"{type(attention).__name__} / {type(mlp).__name__}: the schedule runs "
            "Megatron-Core's SelfAttention and MLP forward (a fused variant such as TE's fused "
            "MLP runs fc1 and fc2 as one op); use the standard layer spec"
        )
        return problems
    linears = _tp_linears(layer)
    if len(linears) < len(_TP_LINEARS):
        problems.append(
            f"missing tensor-parallel linears: {sorted(set(_TP_LINEARS) - set(linears))}"
        )
    for name, module in linears.items():
        problems += _linear_problems(name, module)
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
        or getattr(attention, "offload_attn_proj", False)
    ):
        problems.append("activation offloading is not supported")
    return problems


#: The tensor-parallel linears of a layer: attribute name -> (parallel mode, local class).
_TP_LINEARS = {
    "linear_qkv": ("column", ColumnParallelLinear),
    "linear_proj": ("row", RowParallelLinear),
    "linear_fc1": ("column", ColumnParallelLinear),
    "linear_fc2": ("row", RowParallelLinear),
}


def _tp_linears(layer: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """``{"linear_qkv": module, ...}``: those of the layer's four tensor-parallel linears it has."""
    attention, mlp = getattr(layer, "self_attention", None), getattr(layer, "mlp", None)
    owners = {"linear_qkv": attention, "linear_proj": attention}
    found = {name: getattr(owners.get(name, mlp), name, None) for name in _TP_LINEARS}
    return {name: module for name, module in found.items() if module is not None}


def _linear_problems(name: str, module: torch.nn.Module) -> list[str]:
    """Domino calls this linear itself: it must be Megatron's own or a TE one it knows."""
    mode, local_class = _TP_LINEARS[name]
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
