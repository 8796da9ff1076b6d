"""Megatron-Core's GPTModel, built from the handful of options a Domino experiment varies.

:class:`~lab.models.model_options.GPTOptions` holds the model's shape and flavour
with Megatron-LM's meanings (re-exported here with the builder); :func:`transformer_config`
turns options into Megatron-Core's ``TransformerConfig``, :func:`layer_spec` picks the layer
implementation and :func:`build_gpt_model` builds the ``GPTModel`` for the current
model-parallel state.

On the CPU the model is initialised there (``use_cpu_initialization``) and, unless asked for,
every Apex/TE fusion is off, since none of their kernels exist on the CPU (the fusion fields
of :class:`GPTOptions` turn Megatron-LM's defaults back on where the CPU can run them). Pass
:func:`~megatron_domino.engine.chunking.causal_attention_mask` (re-exported here) explicitly:
Megatron's default causal mask is created on CUDA.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from lab.models.model_options import GPTOptions, GPTOptionsError
from megatron_domino.engine.chunking import causal_attention_mask
from megatron_domino.specs.norms import SequenceParallelTorchNorm

__all__ = [
    "MAKE_VOCAB_SIZE_DIVISIBLE_BY",
    "GPTOptions",
    "GPTOptionsError",
    "build_gpt_model",
    "causal_attention_mask",
    "layer_spec",
    "padded_vocab_size",
    "stage_model_kwargs",
    "transformer_config",
]

#: Megatron-LM's ``--make-vocab-size-divisible-by`` default; the padded vocabulary is a
#: multiple of this times the TP size, so every TP rank holds an equal, aligned vocab shard.
MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128


def padded_vocab_size(vocab_size: int, tensor_model_parallel_size: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``128 * TP``, as Megatron-LM pads it."""
    multiple = MAKE_VOCAB_SIZE_DIVISIBLE_BY * tensor_model_parallel_size
    return (vocab_size + multiple - 1) // multiple * multiple


#: GPTOptions fields that TransformerConfig takes under the same name and meaning.
_SAME_NAMED = """
    num_layers hidden_size num_attention_heads normalization add_bias_linear attention_dropout
    hidden_dropout init_method_std bf16 sequence_parallel recompute_granularity recompute_method
    recompute_num_layers fp8_recipe fp8_margin fp8_amax_history_len fp8_amax_compute_algo
    gradient_accumulation_fusion use_te_activation_func
""".split()


def transformer_config(
    options: GPTOptions, *, tensor_model_parallel_size: int, pipeline_model_parallel_size: int = 1
) -> TransformerConfig:
    """Megatron-Core's ``TransformerConfig`` for ``options`` at the given TP and PP sizes.

    Fusions: each of ``options``' fusion fields left at ``None`` is off on the CPU (Apex and
    TE kernels do not exist there) and, with CUDA, on for the TE implementation only (the
    local spec would need Apex's softmax kernel). ``gradient_accumulation_fusion`` is off
    unless asked for, because it needs Megatron DDP's ``main_grad`` on every weight, and
    ``persist_layer_norm`` is off because it needs Apex.

    Raises:
        GPTOptionsError: ``masked_softmax_fusion`` where Megatron's local attention would ask
            for its fused-softmax CUDA extension (bf16, ``16 < seq_length <= 4096``) and the
            extension is not installed.
    """
    options.check_tensor_parallel(tensor_model_parallel_size)
    cuda = torch.cuda.is_available()
    fused = cuda and options.transformer_impl == "transformer_engine"
    dtype = torch.bfloat16 if options.bf16 else torch.float32

    def fusion(requested: bool | None) -> bool:
        return fused if requested is None else requested

    masked_softmax_fusion = fusion(options.masked_softmax_fusion)
    local_softmax = not cuda or options.transformer_impl == "local"
    if (
        masked_softmax_fusion
        and local_softmax
        and options.bf16
        and 16 < options.seq_length <= 4096
        and not _importable(_SOFTMAX_KERNEL)
    ):
        raise GPTOptionsError(
            f"--masked-softmax-fusion at --seq-length {options.seq_length} in bf16 runs "
            f"Megatron's fused softmax, whose CUDA extension {_SOFTMAX_KERNEL} is not "
            "installed; drop the fusion or use sequences of at most 16 tokens (where Megatron "
            "takes torch's softmax)."
        )
    return TransformerConfig(
        **{name: getattr(options, name) for name in _SAME_NAMED},
        ffn_hidden_size=options.resolved_ffn_hidden_size,
        num_query_groups=options.resolved_num_query_groups,
        gated_linear_unit=options.swiglu,
        activation_func=F.silu if options.swiglu else F.gelu,
        params_dtype=dtype,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        pipeline_dtype=dtype if pipeline_model_parallel_size > 1 else None,
        recompute_modules=list(options.recompute_modules),
        fp8=options.fp8_format,
        use_cpu_initialization=not cuda,
        # The gelu bias fusion requires a bias; Megatron-LM drops it with --disable-bias-linear.
        bias_activation_fusion=fusion(options.bias_activation_fusion)
        and (options.swiglu or options.add_bias_linear),
        bias_dropout_fusion=fusion(options.bias_dropout_fusion),
        masked_softmax_fusion=masked_softmax_fusion,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )


#: The extension Megatron's fused-softmax eligibility check imports (fusions/fused_softmax.py).
_SOFTMAX_KERNEL = "scaled_masked_softmax_cuda"


def _importable(module: str) -> bool:
    """Whether ``import module`` would find it (also a stand-in put into ``sys.modules``)."""
    return module in sys.modules or importlib.util.find_spec(module) is not None


def layer_spec(options: GPTOptions) -> ModuleSpec:
    """The transformer layer spec for ``options.transformer_impl``.

    Raises:
        ImportError: Transformer Engine was asked for but does not import.
        GPTOptionsError: Transformer Engine was asked for without CUDA.
    """
    if options.transformer_impl == "local":
        spec = get_gpt_layer_local_spec(normalization=options.normalization)
        if not options.sequence_parallel:
            return spec
        # The local spec's torch norm refuses sequence parallelism (Apex's needs CUDA).
        norms = dict(
            input_layernorm=SequenceParallelTorchNorm, pre_mlp_layernorm=SequenceParallelTorchNorm
        )
        return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **norms))
    if not torch.cuda.is_available():
        raise GPTOptionsError(
            "--transformer-impl transformer_engine needs a CUDA device; use "
            "--transformer-impl local on the CPU."
        )
    try:
        import transformer_engine  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "--transformer-impl transformer_engine needs Transformer Engine, which does not "
            "import here. Install it with `pip install 'megatron-domino[gpu]'`, or use "
            "--transformer-impl local."
        ) from err
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )

    return get_gpt_layer_with_transformer_engine_spec()


def build_gpt_model(options: GPTOptions, *, spec: ModuleSpec | None = None) -> GPTModel:
    """Build the GPTModel shard of this rank, for the TP size of the current parallel state.

    ``spec`` replaces the layer spec :func:`layer_spec` would pick (e.g. Megatron-Core's TE spec
    in the tests' ranks, where TE's Python runs on the CPU).

    Needs ``megatron.core.parallel_state`` initialised (see
    :func:`megatron_domino.runtime.distributed.init_distributed`). The model is built as Megatron-LM's
    ``pretrain_gpt`` builds it: it takes token ids ``[b, s]``, position ids ``[b, s]`` and a
    mask ``[1, 1, s, s]`` and returns logits ``[b, s, V_pad / TP]`` (this rank's vocabulary
    shard), or with ``labels=[b, s]`` the per-token loss ``[b, s]``. Under pipeline
    parallelism it is this stage's share of the layers: the first stage embeds, the last
    computes the output (the others take their input through ``set_input_tensor``). It is
    not wrapped in ``Float16Module`` or DDP; the training loop does that.
    """
    kwargs = stage_model_kwargs(options)
    return GPTModel(
        transformer_layer_spec=_block_spec(options, spec or layer_spec(options), kwargs["config"]),
        **kwargs,
    )


def stage_model_kwargs(options: GPTOptions) -> dict:
    """What Megatron-Core's ``GPTModel`` and ``HybridModel`` take alike for this rank's pipeline
    stage: the ``TransformerConfig`` at the current TP and PP sizes, the padded vocabulary, the
    positions, which of the model's ends the stage has, and whether the embedding and output
    weights are tied."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    config = transformer_config(
        options,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
    )
    return dict(
        config=config,
        vocab_size=padded_vocab_size(options.vocab_size, tp),
        max_sequence_length=options.resolved_max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=not options.untie_embeddings_and_output_weights,
        position_embedding_type=options.position_embedding_type,
    )


def _block_spec(
    options: GPTOptions, spec: ModuleSpec, config: TransformerConfig
) -> ModuleSpec | TransformerBlockSubmodules:
    """The layer spec, or a block spec where the final norm must not be Megatron's default.

    Megatron-Core's default final norm (Apex's, or without Apex a torch norm that refuses
    sequence parallelism) is replaced by TE's fused norm under ``transformer_engine`` (as
    Megatron-LM's TE block spec has it) and by :class:`SequenceParallelTorchNorm` under
    sequence parallelism otherwise. A block spec lists this pipeline stage's layers only.
    """
    if options.transformer_impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TENorm

        final_norm = TENorm
    elif options.sequence_parallel:
        final_norm = SequenceParallelTorchNorm
    else:
        return spec
    return TransformerBlockSubmodules(
        layer_specs=[spec] * get_num_layers_to_build(config), layer_norm=final_norm
    )
