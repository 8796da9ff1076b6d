"""The shape and flavour of a GPT model, with Megatron-LM's meanings, validated when built.

Each field of :class:`GPTOptions` names its Megatron-LM flag; :meth:`GPTOptions.check_tensor_parallel`
adds the checks that depend on the TP size. :mod:`lab.models.gpt_model` builds the
model from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "FP8_AMAX_COMPUTE_ALGOS",
    "FP8_FORMATS",
    "FP8_RECIPES",
    "LLAMA_FLAVOUR",
    "RECOMPUTE_GRANULARITIES",
    "RECOMPUTE_METHODS",
    "RECOMPUTE_MODULES",
    "GPTOptions",
    "GPTOptionsError",
]

#: The Llama flavour of a layer as :class:`GPTOptions` fields (RMSNorm, SwiGLU, RoPE, no linear
#: bias), dropout off: the tools' measured models (bench, host time, activation memory, GPU
#: check) add their shapes to it.
LLAMA_FLAVOUR = dict(
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    add_bias_linear=False,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)

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
    """Tokenizer vocabulary before padding (see :func:`~lab.models.gpt_model.padded_vocab_size`)."""
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
    use_te_activation_func: bool = False
    """``TransformerConfig.use_te_activation_func``: the MLP's activation as Transformer
    Engine's op (TE layers only; with a spec that builds it, e.g. ``te_spec``'s)."""
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
