"""Megatron-Core's GPTModel, built from the handful of options a Domino experiment varies.

:class:`GPTOptions` holds the model's shape and flavour with Megatron-LM's meanings (each field
names its Megatron-LM flag), validated when built; :meth:`GPTOptions.check_tensor_parallel`
adds the checks that depend on the TP size. :func:`transformer_config` turns options into
Megatron-Core's ``TransformerConfig``, :func:`layer_spec` picks the layer implementation and
:func:`build_gpt_model` builds the ``GPTModel`` for the current model-parallel state.

On the CPU the model is initialised there (``use_cpu_initialization``) and, unless asked for,
every Apex/TE fusion is off, since none of their kernels exist on the CPU (the fusion fields
of :class:`GPTOptions` turn Megatron-LM's defaults back on where the CPU can run them). Pass
:func:`causal_attention_mask` explicitly: Megatron's default causal mask is created on CUDA.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from dataclasses import dataclass
from typing import Literal

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

from megatron_domino.norms import SequenceParallelTorchNorm

__all__ = [
    "FP8_AMAX_COMPUTE_ALGOS",
    "FP8_FORMATS",
    "FP8_RECIPES",
    "MAKE_VOCAB_SIZE_DIVISIBLE_BY",
    "RECOMPUTE_GRANULARITIES",
    "RECOMPUTE_METHODS",
    "RECOMPUTE_MODULES",
    "GPTOptions",
    "GPTOptionsError",
    "build_gpt_model",
    "causal_attention_mask",
    "layer_spec",
    "padded_vocab_size",
    "transformer_config",
]

#: Megatron-LM's ``--make-vocab-size-divisible-by`` default; the padded vocabulary is a
#: multiple of this times the TP size, so every TP rank holds an equal, aligned vocab shard.
MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128

_NORMALIZATIONS = ("LayerNorm", "RMSNorm")
_POSITION_EMBEDDINGS = ("learned_absolute", "rope")
_TRANSFORMER_IMPLS = ("local", "transformer_engine")
#: Megatron-LM's ``--fp8-format`` and ``--fp8-recipe`` choices.
FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")
FP8_AMAX_COMPUTE_ALGOS = ("most_recent", "max")
#: Megatron-LM's ``--recompute-*`` choices for dense GPT models.
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp")


class GPTOptionsError(ValueError):
    """An invalid model option or combination; the message names the numbers and the fix."""


def padded_vocab_size(vocab_size: int, tensor_model_parallel_size: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``128 * TP``, as Megatron-LM pads it."""
    multiple = MAKE_VOCAB_SIZE_DIVISIBLE_BY * tensor_model_parallel_size
    return (vocab_size + multiple - 1) // multiple * multiple


@dataclass(frozen=True, kw_only=True)
class GPTOptions:
    """Shape and flavour of a GPT model, with Megatron-LM's meanings and defaults.

    Optional fields left at ``None`` take Megatron-LM's derived default; read the resolved
    values from the ``resolved_*`` properties.
    """

    num_layers: int
    """``--num-layers``: transformer layers."""
    hidden_size: int
    """``--hidden-size``: h, the width of the residual stream ``[s, b, h]``."""
    num_attention_heads: int
    """``--num-attention-heads``: query heads; each has ``h / heads`` channels."""
    seq_length: int
    """``--seq-length``: s, tokens per sample."""
    vocab_size: int
    """Tokenizer vocabulary before padding (see :func:`padded_vocab_size`)."""
    ffn_hidden_size: int | None = None
    """``--ffn-hidden-size``: MLP width; ``None`` gives 4h, or ``int(8h/3 / 64) * 64`` with
    SwiGLU (which has two input projections)."""
    num_query_groups: int | None = None
    """``--num-query-groups`` (grouped-query attention): key/value heads shared by
    ``heads / groups`` query heads each; ``None`` is multi-head attention (groups = heads)."""
    max_position_embeddings: int | None = None
    """``--max-position-embeddings``: rows of the learned position table; ``None`` gives
    ``seq_length``."""
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """``--normalization``."""
    swiglu: bool = False
    """``--swiglu``: gated SiLU MLP; fc1 holds the gate and up projections."""
    position_embedding_type: Literal["learned_absolute", "rope"] = "learned_absolute"
    """``--position-embedding-type``."""
    add_bias_linear: bool = True
    """False is ``--disable-bias-linear``: no biases in any linear layer."""
    untie_embeddings_and_output_weights: bool = False
    """``--untie-embeddings-and-output-weights``: a separate output layer instead of reusing
    the word embedding."""
    attention_dropout: float = 0.1
    """``--attention-dropout``: dropout on attention probabilities (TP-rank-specific RNG)."""
    hidden_dropout: float = 0.1
    """``--hidden-dropout``: dropout before each residual add (RNG shared across TP ranks)."""
    init_method_std: float = 0.02
    """``--init-method-std``: standard deviation of the normal weight initialisation."""
    bf16: bool = False
    """``--bf16``: parameters and activations in bfloat16."""
    transformer_impl: Literal["local", "transformer_engine"] = "local"
    """``--transformer-impl``: Megatron-Core's own modules (``local``, the only choice on the
    CPU, and the one Domino patches) or Transformer Engine's."""
    sequence_parallel: bool = False
    """``--sequence-parallel``: shard the residual stream ``[s/tp, b, h]`` along the sequence
    between the tensor-parallel regions (needs ``seq_length`` divisible by the TP size)."""
    recompute_granularity: Literal["full", "selective"] | None = None
    """``--recompute-granularity``: recompute activations in backward instead of keeping them:
    ``selective`` recomputes ``recompute_modules``; ``full`` whole layers."""
    recompute_modules: tuple[str, ...] = ("core_attn",)
    """``--recompute-modules`` (selective): any of ``core_attn``, ``layernorm``, ``mlp``."""
    recompute_method: Literal["uniform", "block"] | None = None
    """``--recompute-method`` (full): ``uniform`` checkpoints groups of
    ``recompute_num_layers`` layers; ``block`` the first ``recompute_num_layers`` layers."""
    recompute_num_layers: int | None = None
    """``--recompute-num-layers`` (full)."""
    fp8_format: Literal["e4m3", "hybrid"] | None = None
    """``--fp8-format``: run the TE linears' GEMMs in FP8 (``hybrid``: e4m3 forward, e5m2
    gradients); ``None`` is off. Needs ``transformer_engine``."""
    fp8_recipe: str = "delayed"
    """``--fp8-recipe``: how scales are chosen; ``delayed`` from an amax history."""
    fp8_margin: int = 0
    """``--fp8-margin``: scale down by ``2**margin`` for headroom."""
    fp8_amax_history_len: int = 1
    """``--fp8-amax-history-len``: steps of amax history (delayed scaling)."""
    fp8_amax_compute_algo: Literal["most_recent", "max"] = "most_recent"
    """``--fp8-amax-compute-algo``: which amax of the history sets the scale."""
    gradient_accumulation_fusion: bool = False
    """``--gradient-accumulation-fusion`` (on in Megatron-LM; off here unless asked for):
    weight gradients are accumulated straight into Megatron DDP's fp32 (or bf16) ``main_grad``
    by Apex's fused weight-gradient GEMM (``fused_weight_gradient_mlp_cuda``). Needs the model
    wrapped in Megatron DDP, which creates ``main_grad``, and the kernels (the CPU tests bind a
    stand-in where Megatron-Core looks them up)."""
    bias_activation_fusion: bool | None = None
    """``--bias-gelu-fusion`` / ``--bias-swiglu-fusion``: Megatron's jit-fused bias +
    activation (runs on the CPU too). ``None``: on with CUDA and Transformer Engine, else off.
    Without a bias the GeLU fusion is off, as Megatron-LM turns it off with
    ``--disable-bias-linear``."""
    bias_dropout_fusion: bool | None = None
    """``--bias-dropout-fusion``: Megatron's jit-fused bias + dropout + residual add (runs on
    the CPU too). ``None``: on with CUDA and Transformer Engine, else off."""
    masked_softmax_fusion: bool | None = None
    """``--masked-softmax-fusion``: Megatron's fused scale-mask-softmax kernel, used where it
    applies (fp16/bf16, ``16 < keys <= 4096``, ...) and torch's softmax elsewhere. ``None``: on
    with CUDA and Transformer Engine, else off. Without the CUDA extension (the CPU) only
    where the kernel never applies: fp32, or sequences of at most 16 tokens (Megatron's
    eligibility check itself imports the extension)."""

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "seq_length",
            "vocab_size",
        ):
            _require_positive(name, getattr(self, name))
        for name in ("ffn_hidden_size", "num_query_groups", "max_position_embeddings"):
            if getattr(self, name) is not None:
                _require_positive(name, getattr(self, name))
        _require_choice("normalization", self.normalization, _NORMALIZATIONS)
        _require_choice(
            "position_embedding_type", self.position_embedding_type, _POSITION_EMBEDDINGS
        )
        _require_choice("transformer_impl", self.transformer_impl, _TRANSFORMER_IMPLS)
        self._check_fp8()
        self._check_recompute()
        for name in ("attention_dropout", "hidden_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise GPTOptionsError(
                    f"{_flag(name)} must be in [0, 1), got {getattr(self, name)}."
                )
        if self.hidden_size % self.num_attention_heads:
            raise GPTOptionsError(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                f"{self.num_attention_heads}: every head needs the same number of channels. "
                "Pick a head count that divides the hidden size."
            )
        if self.num_attention_heads % self.resolved_num_query_groups:
            raise GPTOptionsError(
                f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                f"--num-query-groups {self.resolved_num_query_groups}: each key/value group "
                "serves the same number of query heads. Pick a group count that divides the "
                "head count."
            )
        if (
            self.position_embedding_type == "learned_absolute"
            and self.resolved_max_position_embeddings < self.seq_length
        ):
            raise GPTOptionsError(
                f"--max-position-embeddings {self.resolved_max_position_embeddings} is smaller "
                f"than --seq-length {self.seq_length}: the learned position table needs a row "
                "per position. Raise it to at least the sequence length."
            )

    def _check_recompute(self) -> None:
        granularity = self.recompute_granularity
        if granularity is None:
            return
        _require_choice("recompute_granularity", granularity, RECOMPUTE_GRANULARITIES)
        if granularity == "selective":
            for module in self.recompute_modules:
                _require_choice("recompute_modules", module, RECOMPUTE_MODULES)
            if self.recompute_method is not None or self.recompute_num_layers is not None:
                raise GPTOptionsError(
                    "--recompute-method and --recompute-num-layers apply to "
                    "--recompute-granularity full; drop them for selective recompute."
                )
            return
        if self.recompute_method is None or self.recompute_num_layers is None:
            raise GPTOptionsError(
                "--recompute-granularity full needs --recompute-method (uniform or block) and "
                "--recompute-num-layers, e.g. --recompute-method uniform --recompute-num-layers 1."
            )
        _require_choice("recompute_method", self.recompute_method, RECOMPUTE_METHODS)
        _require_positive("recompute_num_layers", self.recompute_num_layers)

    def _check_fp8(self) -> None:
        _require_choice("fp8_recipe", self.fp8_recipe, FP8_RECIPES)
        _require_choice("fp8_amax_compute_algo", self.fp8_amax_compute_algo, FP8_AMAX_COMPUTE_ALGOS)
        _require_positive("fp8_amax_history_len", self.fp8_amax_history_len)
        if self.fp8_format is None:
            return
        _require_choice("fp8_format", self.fp8_format, FP8_FORMATS)
        if self.transformer_impl != "transformer_engine":
            raise GPTOptionsError(
                f"--fp8-format {self.fp8_format} runs in Transformer Engine's linears; add "
                "--transformer-impl transformer_engine or drop --fp8-format."
            )

    @property
    def resolved_ffn_hidden_size(self) -> int:
        """MLP width: ``ffn_hidden_size`` or Megatron-LM's default for this model."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.swiglu:
            return int(4 * self.hidden_size * 2 / 3 / 64) * 64
        return 4 * self.hidden_size

    @property
    def resolved_num_query_groups(self) -> int:
        """Key/value heads: ``num_query_groups``, or the head count (multi-head attention)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def resolved_max_position_embeddings(self) -> int:
        """Longest sequence the model accepts: ``max_position_embeddings`` or ``seq_length``."""
        return self.max_position_embeddings or self.seq_length

    def check_tensor_parallel(self, tensor_model_parallel_size: int) -> None:
        """Raise :class:`GPTOptionsError` unless every TP-split dimension divides evenly.

        Column-parallel layers split query heads, key/value groups and the MLP width across
        the TP ranks, each of which must get an equal share.
        """
        tp = tensor_model_parallel_size
        if self.sequence_parallel and self.seq_length % tp:
            raise GPTOptionsError(
                f"--seq-length {self.seq_length} is not divisible by --tensor-model-parallel-size "
                f"{tp}: --sequence-parallel gives each rank an equal share of the tokens."
            )
        split = (
            ("num_attention_heads", self.num_attention_heads),
            ("num_query_groups", self.resolved_num_query_groups),
            ("ffn_hidden_size", self.resolved_ffn_hidden_size),
        )
        for name, value in split:
            if value % tp:
                raise GPTOptionsError(
                    f"{_flag(name)} {value} is not divisible by --tensor-model-parallel-size "
                    f"{tp}: tensor parallelism gives each rank an equal share. Use a TP size "
                    f"that divides {value}, or a {_flag(name)} that is a multiple of {tp}."
                )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _require_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise GPTOptionsError(f"{_flag(name)} must be an integer >= 1, got {value!r}.")


def _require_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise GPTOptionsError(f"{_flag(name)} must be one of {', '.join(choices)}; got {value!r}.")


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
        num_layers=options.num_layers,
        hidden_size=options.hidden_size,
        ffn_hidden_size=options.resolved_ffn_hidden_size,
        num_attention_heads=options.num_attention_heads,
        num_query_groups=options.resolved_num_query_groups,
        normalization=options.normalization,
        gated_linear_unit=options.swiglu,
        activation_func=F.silu if options.swiglu else F.gelu,
        add_bias_linear=options.add_bias_linear,
        attention_dropout=options.attention_dropout,
        hidden_dropout=options.hidden_dropout,
        init_method_std=options.init_method_std,
        bf16=options.bf16,
        params_dtype=dtype,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        pipeline_dtype=dtype if pipeline_model_parallel_size > 1 else None,
        sequence_parallel=options.sequence_parallel,
        recompute_granularity=options.recompute_granularity,
        recompute_modules=list(options.recompute_modules),
        recompute_method=options.recompute_method,
        recompute_num_layers=options.recompute_num_layers,
        fp8=options.fp8_format,
        fp8_recipe=options.fp8_recipe,
        fp8_margin=options.fp8_margin,
        fp8_amax_history_len=options.fp8_amax_history_len,
        fp8_amax_compute_algo=options.fp8_amax_compute_algo,
        use_cpu_initialization=not cuda,
        # The gelu bias fusion requires a bias; Megatron-LM drops it with --disable-bias-linear.
        bias_activation_fusion=fusion(options.bias_activation_fusion)
        and (options.swiglu or options.add_bias_linear),
        bias_dropout_fusion=fusion(options.bias_dropout_fusion),
        masked_softmax_fusion=masked_softmax_fusion,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=options.gradient_accumulation_fusion,
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

    ``spec`` replaces the layer spec :func:`layer_spec` would pick (e.g. the CPU stand-ins for
    Transformer Engine layers in the tests).

    Needs ``megatron.core.parallel_state`` initialised (see
    :func:`megatron_domino.distributed.init_distributed`). The model is built as Megatron-LM's
    ``pretrain_gpt`` builds it: it takes token ids ``[b, s]``, position ids ``[b, s]`` and a
    mask ``[1, 1, s, s]`` and returns logits ``[b, s, V_pad / TP]`` (this rank's vocabulary
    shard), or with ``labels=[b, s]`` the per-token loss ``[b, s]``. Under pipeline
    parallelism it is this stage's share of the layers: the first stage embeds, the last
    computes the output (the others take their input through ``set_input_tensor``). It is
    not wrapped in ``Float16Module`` or DDP; the training loop does that.
    """
    tp = parallel_state.get_tensor_model_parallel_world_size()
    config = transformer_config(
        options,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=_block_spec(options, spec or layer_spec(options), config),
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


def causal_attention_mask(seq_length: int, device: torch.device | str) -> torch.Tensor:
    """Megatron's boolean causal mask ``[1, 1, s, s]``: True where attention is masked out.

    Query position i may attend key positions j <= i, so True is strictly above the diagonal.
    It broadcasts over batch and heads. Passing it keeps Megatron from building its default
    mask, which it creates on CUDA.
    """
    ones = torch.ones(seq_length, seq_length, dtype=torch.bool, device=device)
    return torch.triu(ones, diagonal=1).view(1, 1, seq_length, seq_length)
