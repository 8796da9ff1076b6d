"""The DeepSpeed-Domino arm: the paper's own transformer block inside our Megatron-Core model.

DeepSpeed ships Domino as ``deepspeed.runtime.domino`` (``DominoTransformer``): a GPT-3-style
block (LayerNorm, GeLU MLP, causal SDPA attention, multi-head, no sequence parallelism) that
always splits the batch into two chunks and overlaps each chunk's tensor-parallel all-reduce
with the other chunk's compute (inter-layer overlap, its default). To time it on exactly the
work our arms do, :func:`build_deepspeed_block` builds one from the model's own
``TransformerConfig`` and copies the weights of ``model.decoder`` into it, and
:func:`deepspeed_decoder` runs it in place of ``model.decoder``: the embedding, the output
layer and the loss stay Megatron-Core's, so every arm does the same work around the block.

Use::

    block = build_deepspeed_block(model)        # after init_distributed; once per process
    with deepspeed_decoder(model, block):
        loss = model(input_ids=..., position_ids=..., attention_mask=..., labels=...)

Its collectives go through ``deepspeed.comm.all_reduce``, which calls
``torch.distributed.all_reduce`` looked up at call time, so
:func:`~lab.bench.noop_collectives.tp_collectives_skipped` gives its
no-communication arm too. DeepSpeed is optional: it is imported only here, on first use
(tested with deepspeed 0.19.8; install with ``make bench DS=1``).

It is one module, past 300 lines, on purpose: what DeepSpeed's block can compute (the
refusals), how it is imported and connected, how its weights are named and how it is swapped
in are all knowledge of one internal API of one DeepSpeed release, which an upgrade changes
together.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import os
import sys
from collections.abc import Iterator
from types import ModuleType

import torch
import torch.distributed as dist
import torch.nn.functional as F
from packaging.version import Version

from lab.models.gpt_model import GPTOptions

__all__ = [
    "DEEPSPEED_TESTED",
    "DeepSpeedUnsupportedError",
    "build_deepspeed_block",
    "deepspeed_decoder",
    "deepspeed_problems",
    "init_deepspeed_comm",
    "to_deepspeed_name",
]

#: The DeepSpeed releases whose ``deepspeed.runtime.domino`` this module was checked against
#: (its names and signatures are internal and may change): ``low <= version < high``.
DEEPSPEED_TESTED = ("0.19.8", "0.20")

_INSTALL = "`make bench DS=1`, or `DS_BUILD_OPS=0 pip install deepspeed==0.19.8`"

#: Megatron-Core local-spec layer submodule -> DeepSpeed ``DominoTransformerLayer`` submodule.
#: Both keep the fused QKV weight per head as ``[q | k | v]`` rows, so weights copy as they are.
_LAYER_NAMES = {
    "input_layernorm": "input_layernorm",
    "self_attention.linear_qkv": "self_attention.query_key_value",
    "self_attention.linear_proj": "self_attention.dense",
    "pre_mlp_layernorm": "post_attention_layernorm",
    "mlp.linear_fc1": "linear_fc1",
    "mlp.linear_fc2": "linear_fc2",
}


class DeepSpeedUnsupportedError(ValueError):
    """DeepSpeed's Domino cannot compute this model's block; the message says why."""


def _problems(
    *,
    normalization: str,
    gated: bool,
    gelu: bool,
    tanh_gelu: bool,
    rope: bool,
    heads: int,
    query_groups: int,
    sequence_parallel: bool,
    attention_dropout: float,
    hidden_dropout: float,
    recompute: bool,
) -> list[str]:
    """The shape rules, shared by the options-level and the model-level check."""
    rules = {
        f"{normalization}: DeepSpeed's Domino layer has torch LayerNorm only": (
            normalization != "LayerNorm"
        ),
        "SwiGLU / gated MLP: DeepSpeed's Domino MLP is fc1 -> GeLU -> fc2 "
        "(it reads gated_linear_unit but ignores it)": gated,
        "activation other than GeLU: DeepSpeed's Domino MLP uses F.gelu": not gated and not gelu,
        "bias-GeLU fusion: Megatron's fused bias-GeLU is the tanh approximation, DeepSpeed's "
        "GeLU the exact one; drop --bias-gelu-fusion": tanh_gelu,
        "RoPE: the arm passes no rotary embedding to DeepSpeed's block; use "
        "--position-embedding-type learned_absolute": rope,
        f"grouped-query attention ({query_groups} key/value groups for {heads} heads): "
        "DeepSpeed's Domino attention is multi-head only": query_groups != heads,
        "sequence parallelism: DeepSpeed's Domino block all-reduces full-sequence "
        "activations; drop --sequence-parallel": sequence_parallel,
        f"dropout (attention {attention_dropout}, hidden {hidden_dropout}): DeepSpeed "
        "draws from torch's RNG, not Megatron's tracker, and applies attention dropout even "
        "in eval mode, so the arms would not compute the same function; use dropout 0": (
            attention_dropout > 0 or hidden_dropout > 0
        ),
        "activation recompute: DeepSpeed's Domino block keeps every activation; drop "
        "--recompute-granularity": recompute,
    }
    return [reason for reason, bad in rules.items() if bad]


def deepspeed_problems(
    options: GPTOptions, micro_batch_size: int, sequence_parallel: bool
) -> list[str]:
    """Why DeepSpeed's Domino cannot run this shape as the same function (empty if it can).

    Args:
        options: the model; the arm maps the local layer spec's weights onto DeepSpeed's.
        micro_batch_size: b; DeepSpeed always splits it into two chunks
            (``torch.chunk(x, 2, dim=1)`` on ``[s, b, h]``), so it must be even.
        sequence_parallel: whether the setting runs the model sequence-parallel (as ``sp-``
            settings do), on top of ``options.sequence_parallel``.
    """
    problems = []
    if options.transformer_impl != "local":
        problems.append(
            f"--transformer-impl {options.transformer_impl}: the weights are copied by the "
            "local layer spec's names; use --transformer-impl local"
        )
    if micro_batch_size % 2:
        problems.append(
            f"odd micro-batch {micro_batch_size}: DeepSpeed's Domino always splits the batch "
            "into 2 chunks; use an even --micro-batch-size"
        )
    problems += _problems(
        normalization=options.normalization,
        gated=options.swiglu,
        gelu=not options.swiglu,
        tanh_gelu=bool(options.bias_activation_fusion)
        and options.add_bias_linear
        and not options.swiglu,
        rope=options.position_embedding_type != "learned_absolute",
        heads=options.num_attention_heads,
        query_groups=options.resolved_num_query_groups,
        sequence_parallel=sequence_parallel or options.sequence_parallel,
        attention_dropout=options.attention_dropout,
        hidden_dropout=options.hidden_dropout,
        recompute=options.recompute_granularity is not None,
    )
    return problems


def _model_problems(model: torch.nn.Module) -> list[str]:
    """:func:`deepspeed_problems` of a built ``GPTModel``, plus what only the model shows."""
    config = model.config
    problems = _problems(
        normalization=config.normalization,
        gated=config.gated_linear_unit,
        gelu=config.activation_func is F.gelu,
        tanh_gelu=config.bias_activation_fusion
        and config.add_bias_linear
        and config.activation_func is F.gelu
        and not config.gated_linear_unit,
        rope=model.position_embedding_type != "learned_absolute",
        heads=config.num_attention_heads,
        query_groups=config.num_query_groups or config.num_attention_heads,
        sequence_parallel=config.sequence_parallel,
        attention_dropout=config.attention_dropout,
        hidden_dropout=config.hidden_dropout,
        recompute=config.recompute_granularity is not None,
    )
    others = {
        "pipeline parallelism: the block replaces the whole decoder of a single-stage model": (
            not (model.pre_process and model.post_process)
        ),
        "a custom softmax scale: DeepSpeed's SDPA uses 1/sqrt(d)": (
            config.softmax_scale is not None
        ),
        "zero-centred LayerNorm (--apply-layernorm-1p)": config.layernorm_zero_centered_gamma,
        "query/key LayerNorm (--qk-layernorm)": config.qk_layernorm,
        "MoE layers": config.num_moe_experts is not None,
    }
    return problems + [reason for reason, bad in others.items() if bad]


def _import_deepspeed() -> ModuleType:
    """``import deepspeed`` for this process's device, checking the tested release.

    ``DS_ACCELERATOR`` is read at import: ``cpu`` without CUDA (its CPU accelerator then
    uses gloo, oneCCL's bindings being absent), else ``cuda``.
    """
    want = "cuda" if torch.cuda.is_available() else "cpu"
    if "deepspeed" not in sys.modules:
        os.environ["DS_ACCELERATOR"] = want
    try:
        import deepspeed
        from deepspeed.accelerator import get_accelerator
    except ImportError as err:
        raise ImportError(
            f"The DeepSpeed-Domino arm needs DeepSpeed, which does not import here ({err}). "
            f"Install it with {_INSTALL}."
        ) from err
    low, high = DEEPSPEED_TESTED
    if not Version(low) <= Version(deepspeed.__version__) < Version(high):
        raise ImportError(
            f"The DeepSpeed-Domino arm was checked against deepspeed >= {low}, < {high}, "
            f"found {deepspeed.__version__} (its Domino module is internal API). Install the "
            f"tested release with {_INSTALL}."
        )
    found = get_accelerator().device_name()
    if found != want:
        raise RuntimeError(
            f"DeepSpeed was imported with the {found!r} accelerator, but this process runs on "
            f"{want!r}; import it only through this module, or set DS_ACCELERATOR={want}."
        )
    return deepspeed


def _no_shm_op() -> None:
    """Stands in for ``build_shm_op``: the shared-memory op is for inference all-reduce only."""
    return None


def init_deepspeed_comm() -> ModuleType:
    """Initialise ``deepspeed.comm`` over the existing process group; return it.

    Call after ``torch.distributed`` is initialised (e.g. by
    :func:`megatron_domino.runtime.distributed.init_distributed`): DeepSpeed then wraps the
    existing default group instead of creating one. Its ``TorchBackend`` would JIT-compile a
    shared-memory C++ op at construction (~25 s with g++, ranks racing on the build cache)
    that Domino never uses; ``build_shm_op`` is a no-op while the backend is built, then
    restored. Calling again is a no-op.

    Raises:
        ImportError: DeepSpeed is missing or outside :data:`DEEPSPEED_TESTED`.
        RuntimeError: ``torch.distributed`` is not initialised.
    """
    _import_deepspeed()
    if not dist.is_initialized():
        raise RuntimeError(
            "init_deepspeed_comm needs torch.distributed initialised first (init_distributed)."
        )
    ds_comm = importlib.import_module("deepspeed.comm")
    if ds_comm.is_initialized():
        return ds_comm
    # Not `import deepspeed.comm.torch`: deepspeed.comm re-exports its global `torch`, so that
    # attribute is the torch package; the module itself is only in sys.modules.
    backend_module = importlib.import_module("deepspeed.comm.torch")
    original = backend_module.build_shm_op
    backend_module.build_shm_op = _no_shm_op
    try:
        ds_comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
    finally:
        backend_module.build_shm_op = original
    return ds_comm


def to_deepspeed_name(name: str) -> str:
    """The name in DeepSpeed's block of the Megatron decoder's parameter ``name``.

    ``layers.3.mlp.linear_fc1.weight`` -> ``layers.3.linear_fc1.weight``;
    ``final_layernorm.bias`` is the same in both.

    Raises:
        KeyError: ``name`` has no counterpart (not a local-spec GPT-3-style layer).
    """
    if name.startswith("final_layernorm."):
        return name
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) >= 4:
        module, leaf = ".".join(parts[2:-1]), parts[-1]
        if module in _LAYER_NAMES:
            return f"layers.{parts[1]}.{_LAYER_NAMES[module]}.{leaf}"
    raise KeyError(f"no DeepSpeed Domino counterpart for Megatron decoder parameter {name!r}")


class _TensorParallelOf:
    """The ``mpu`` DeepSpeed's Domino reads: only the TP group and its size, the model's own."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self._group = group

    def get_tensor_model_parallel_group(self) -> dist.ProcessGroup:
        return self._group

    def get_tensor_model_parallel_world_size(self) -> int:
        return dist.get_world_size(self._group)


def build_deepspeed_block(model: torch.nn.Module) -> torch.nn.Module:
    """DeepSpeed's ``DominoTransformer`` computing ``model.decoder``'s function.

    Built from a copy of ``model.config`` (DeepSpeed reads a Megatron-style config: layers,
    widths, heads, ``kv_channels``, dropouts, epsilon, biases, dtype) with inter-layer
    overlap, its default, on the TP group of the model's layers. Every parameter is then
    replaced by a copy of the Megatron decoder's (layers and final LayerNorm, by
    :func:`to_deepspeed_name`), keeping the source's dtype and device, so the two blocks
    compute the same function ``[s, b, h] -> [s, b, h]`` on this rank's shards (QKV and fc1
    rows ``[3h/tp]``/``[ffn/tp]``, proj and fc2 columns, replicated norms and row biases).

    DeepSpeed keeps class- and module-level state (``DominoUtil.HANDLE_DIC``, the TP group
    of ``async_linear`` fixed at the first construction): one block per process.

    Args:
        model: a single-stage Megatron-Core ``GPTModel`` from the local layer spec (stock or
            :func:`~lab.bench.sdpa_attention.sdpa_layer_spec`), built after
            :func:`~megatron_domino.runtime.distributed.init_distributed`.
    Raises:
        DeepSpeedUnsupportedError: the model is outside what DeepSpeed's Domino computes.
        RuntimeError: a DeepSpeed Domino block was already built in this process.
        ImportError: DeepSpeed is missing (see :func:`init_deepspeed_comm`).
    """
    problems = _model_problems(model)
    if problems:
        raise DeepSpeedUnsupportedError(
            "DeepSpeed's Domino cannot compute this model's block:\n  - " + "\n  - ".join(problems)
        )
    init_deepspeed_comm()
    from deepspeed.runtime.domino import async_linear
    from deepspeed.runtime.domino.transformer import (
        AttnMaskType,
        DominoTransformer,
        LayerType,
        ModelType,
    )

    if async_linear.TP_group is not None:
        raise RuntimeError(
            "A DeepSpeed Domino block was already built in this process; DeepSpeed keeps its "
            "TP group and communication handles in module and class state, so build one "
            "block per process and reuse it."
        )
    tp_group = model.decoder.layers[0].self_attention.linear_proj.tp_group
    config = copy.copy(model.config)
    config.domino_intra_layer_overlap = False
    config.perform_initialization = False  # every weight is copied from the decoder below
    block = DominoTransformer(
        config,
        mpu=_TensorParallelOf(tp_group),
        apply_rotary_pos_emb=None,
        model_type=ModelType.encoder_or_decoder,
        layer_type=LayerType.encoder,
        self_attn_mask_type=AttnMaskType.causal,
        post_layer_norm=True,
        pre_process=True,
        post_process=True,
    )
    _copy_decoder_weights(model.decoder, block)
    block.train(model.training)
    return block


def _copy_decoder_weights(decoder: torch.nn.Module, block: torch.nn.Module) -> None:
    """Load copies of ``decoder``'s parameters into ``block``; every one must map."""
    mapped, unknown = {}, []
    for name, tensor in decoder.state_dict().items():
        if name.endswith("_extra_state"):
            continue
        try:
            mapped[to_deepspeed_name(name)] = tensor.detach().clone()
        except KeyError:
            unknown.append(name)
    expected = set(block.state_dict())
    missing = sorted(expected - set(mapped))
    if unknown or missing:
        raise DeepSpeedUnsupportedError(
            "The decoder's parameters do not map one to one onto DeepSpeed's Domino block "
            f"(not the local layer spec?): no counterpart for {unknown}, not provided "
            f"{missing}."
        )
    # assign=True: the block's parameters take the decoder's dtype and device.
    block.load_state_dict(mapped, strict=True, assign=True)


class _DeepSpeedDecoder(torch.nn.Module):
    """Takes ``TransformerBlock``'s keyword call from ``GPTModel`` and runs DeepSpeed's block."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden_states: torch.Tensor, attention_mask, **kwargs) -> torch.Tensor:
        """``[s, b, h]`` -> ``[s, b, h]``; the mask is the causal one DeepSpeed applies itself."""
        unsupported = sorted(name for name, value in kwargs.items() if value is not None)
        if unsupported:
            raise DeepSpeedUnsupportedError(
                f"DeepSpeed's Domino block takes none of {unsupported} (inference, rotary or "
                "packed sequences)."
            )
        return self.block(hidden_states, attention_mask)

    def set_input_tensor(self, input_tensor) -> None:
        if input_tensor is not None:
            raise DeepSpeedUnsupportedError(
                "DeepSpeed's Domino block replaces a single-stage decoder (no pipeline input)."
            )


@contextlib.contextmanager
def deepspeed_decoder(model: torch.nn.Module, block: torch.nn.Module) -> Iterator[None]:
    """Within the block, ``model(...)`` runs DeepSpeed's ``block`` in place of its decoder.

    ``model.decoder`` is swapped for a module holding ``block`` (so ``model.parameters()``
    and ``model.zero_grad()`` reach DeepSpeed's weights inside it) and restored on exit.
    Embedding ``[b, s] -> [s, b, h]``, output layer ``[s, b, h] -> [b, s, V/tp]`` and loss
    stay Megatron-Core's.

    Raises:
        RuntimeError: already inside a ``deepspeed_decoder`` of this model.
    """
    decoder = model.decoder
    if isinstance(decoder, _DeepSpeedDecoder):
        raise RuntimeError("model.decoder is already DeepSpeed's block; leave the first context.")
    model.decoder = _DeepSpeedDecoder(block)
    try:
        yield
    finally:
        model.decoder = decoder
