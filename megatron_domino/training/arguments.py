"""Command-line flags of ``pretrain_gpt_domino.py``, with Megatron-LM's names and meanings.

The parsed :class:`argparse.Namespace` is the run's one configuration object: it is validated
as a whole right after parsing (before anything is written or any process group exists), and
never modified afterwards. Quantities that follow from several flags and the launch (data
parallel size, gradient-accumulation steps, ...) are computed by :class:`Layout` and the small
functions below instead of being written back into the namespace, so a printed namespace is
always exactly what the user asked for.

Model flags map 1:1 onto :class:`~megatron_domino.gpt_model.GPTOptions` (built by
:func:`model_options`), which resolves Megatron-LM's derived defaults (FFN width, query
groups, position-table size) and checks the model's shapes. Only the subset of Megatron-LM's
flags that this trainer implements is accepted; an unknown Megatron flag is an argparse error
rather than being silently ignored.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from dataclasses import dataclass

import torch
from megatron.core.datasets.indexed_dataset import get_bin_path, get_idx_path
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.tokenizers import MegatronTokenizerBase

from megatron_domino.config import DominoConfig, DominoConfigError, add_domino_args
from megatron_domino.data.datasets import TOKENIZER_TYPES, DataConfigError, build_tokenizer
from megatron_domino.data.files import PREPARE_COMMAND, DataFileError, require_readable_file
from megatron_domino.gpt_model import (
    FP8_AMAX_COMPUTE_ALGOS,
    FP8_FORMATS,
    FP8_RECIPES,
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_METHODS,
    RECOMPUTE_MODULES,
    GPTOptions,
    GPTOptionsError,
)
from megatron_domino.integration import recompute_problems
from megatron_domino.te_linears import te_problems

#: Where --mock-data keeps its sample indices when --data-cache-path is not given.
MOCK_DATA_CACHE = os.path.join("data_cache", "mock")


class ArgumentsError(ValueError):
    """An invalid flag or combination of flags; the message names the problem and the fix."""


def build_parser() -> argparse.ArgumentParser:
    """The parser with every flag, grouped as in Megatron-LM; no validation happens here."""
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt_domino.py",
        description="GPT pretraining on Megatron-Core with Megatron-LM's flags, optionally "
        "with Domino hiding the tensor-parallel communication.",
        allow_abbrev=False,
    )
    _add_model_args(parser)
    _add_parallel_args(parser)
    _add_batch_args(parser)
    _add_optimizer_args(parser)
    _add_recompute_args(parser)
    _add_fp8_args(parser)
    _add_data_args(parser)
    _add_checkpoint_args(parser)
    _add_logging_args(parser)
    add_domino_args(parser)
    _add_domino_report_args(parser)
    return parser


def parse_args(argv: list[str] | None, *, world_size: int) -> argparse.Namespace:
    """Parse and validate ``argv``; on an invalid value, print the reason and exit with 2.

    Args:
        argv: the flags (``None``: ``sys.argv[1:]``).
        world_size: number of ranks the run is launched with; batch and tensor-parallel
            sizes are checked against it before any process group is created.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        validate_args(args, world_size=world_size)
    except ArgumentsError as err:
        parser.error(str(err))
    return args


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model", "GPT model shape (Megatron-LM's flags).")
    group.add_argument("--num-layers", type=int, required=True, help="Transformer layers.")
    group.add_argument("--hidden-size", type=int, required=True, help="Transformer hidden size h.")
    group.add_argument(
        "--ffn-hidden-size",
        type=int,
        default=None,
        help="MLP hidden size. Default: 4*h, or int(4*h*2/3 / 64)*64 with --swiglu "
        "(Megatron-LM's rule, which keeps the parameter count close to 4*h).",
    )
    group.add_argument(
        "--num-attention-heads", type=int, required=True, help="Attention heads; must divide h."
    )
    group.add_argument(
        "--group-query-attention",
        action="store_true",
        help="Use grouped-query attention with --num-query-groups key/value heads.",
    )
    group.add_argument(
        "--num-query-groups",
        type=int,
        default=1,
        help="Key/value heads under --group-query-attention (ignored without it). Default: 1.",
    )
    group.add_argument(
        "--seq-length", type=int, required=True, help="Tokens per training sequence."
    )
    group.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        help="Size of the learned position-embedding table. Default: --seq-length.",
    )
    group.add_argument(
        "--normalization",
        choices=("LayerNorm", "RMSNorm"),
        default="LayerNorm",
        help="Norm before attention, before the MLP and after the last layer. Default: LayerNorm.",
    )
    group.add_argument(
        "--swiglu", action="store_true", help="Gated SiLU MLP (SwiGLU) instead of GeLU."
    )
    group.add_argument(
        "--position-embedding-type",
        choices=("learned_absolute", "rope"),
        default="learned_absolute",
        help="Learned absolute position embeddings or rotary embeddings (RoPE). "
        "Default: learned_absolute.",
    )
    group.add_argument(
        "--disable-bias-linear", action="store_true", help="No biases in the linear layers."
    )
    group.add_argument(
        "--attention-dropout", type=float, default=0.1, help="Dropout on attention probabilities."
    )
    group.add_argument(
        "--hidden-dropout", type=float, default=0.1, help="Dropout before each residual add."
    )
    group.add_argument(
        "--init-method-std",
        type=float,
        default=0.02,
        help="Standard deviation of the normal weight initialisation. Default: 0.02.",
    )
    group.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="Give the output layer its own weights instead of reusing the word embedding.",
    )
    group.add_argument(
        "--transformer-impl",
        choices=("local", "transformer_engine"),
        default="local",
        help="Layer implementation: Megatron-Core's own modules ('local', runs on CPU) or "
        "Transformer Engine's (needs a GPU and transformer-engine installed). Default: local "
        "(Megatron-LM defaults to transformer_engine).",
    )


def _add_parallel_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("parallelism")
    group.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="Tensor-parallel ranks per model replica; data-parallel size = world size / "
        "(TP x PP).",
    )
    group.add_argument(
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        help="Pipeline stages, each holding --num-layers / PP consecutive layers; Megatron-Core's "
        "one-forward-one-backward schedule runs the micro-batches through them. Default: 1.",
    )
    group.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Shard the residual stream along the sequence between tensor-parallel regions "
        "(all-gather/reduce-scatter instead of all-reduce); needs TP > 1 and --seq-length "
        "divisible by TP.",
    )
    group.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="Overlap the data-parallel gradient reduction with the backward pass (DDP buckets).",
    )
    group.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="Shard the optimizer state over data-parallel ranks (ZeRO-1).",
    )


def _add_batch_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("batch")
    group.add_argument(
        "--micro-batch-size", type=int, required=True, help="Sequences per forward/backward pass."
    )
    group.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="Sequences per optimizer step over all data-parallel ranks; gradient accumulation "
        "steps = global / (micro * data-parallel size). Default: micro * data-parallel size.",
    )


def _add_optimizer_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("optimizer", "Adam (decoupled weight decay) and schedule.")
    group.add_argument("--lr", type=float, required=True, help="Peak learning rate.")
    group.add_argument(
        "--min-lr", type=float, default=0.0, help="Learning rate at the end of decay. Default: 0."
    )
    group.add_argument(
        "--lr-warmup-iters",
        type=int,
        default=0,
        help="Iterations of linear warmup from 0 to --lr. Default: 0.",
    )
    group.add_argument(
        "--lr-decay-iters",
        type=int,
        default=None,
        help="Iterations over which the learning rate decays to --min-lr. Default: --train-iters.",
    )
    group.add_argument(
        "--lr-decay-style",
        choices=("constant", "linear", "cosine"),
        default="linear",
        help="Decay after warmup. Default: linear.",
    )
    group.add_argument(
        "--weight-decay", type=float, default=0.01, help="Decoupled weight decay. Default: 0.01."
    )
    group.add_argument(
        "--clip-grad",
        type=float,
        default=1.0,
        help="Clip gradients to this global L2 norm; 0 disables clipping. Default: 1.0.",
    )
    group.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1. Default: 0.9.")
    group.add_argument(
        "--adam-beta2", type=float, default=0.999, help="Adam beta2. Default: 0.999."
    )
    group.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon. Default: 1e-8.")
    group.add_argument(
        "--train-iters",
        type=int,
        required=True,
        help="Total optimizer steps, counting those done before a resumed checkpoint.",
    )
    group.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 parameters and activations with fp32 main weights and gradients.",
    )
    group.add_argument(
        "--seed", type=int, default=1234, help="Seed of every random generator. Default: 1234."
    )


def _add_recompute_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "activation recompute", "Trade compute for activation memory (Megatron-LM's flags)."
    )
    group.add_argument(
        "--recompute-activations",
        action="store_true",
        help="Selective recompute of the core attention; same as --recompute-granularity "
        "selective with the default modules.",
    )
    group.add_argument(
        "--recompute-granularity",
        choices=RECOMPUTE_GRANULARITIES,
        default=None,
        help="selective: recompute --recompute-modules in backward; full: whole layers "
        "(needs --recompute-method and --recompute-num-layers).",
    )
    group.add_argument(
        "--recompute-modules",
        nargs="+",
        choices=RECOMPUTE_MODULES,
        default=None,
        help="Selective recompute: which parts. Default: core_attn (the only one --domino "
        "supports).",
    )
    group.add_argument(
        "--recompute-method",
        choices=RECOMPUTE_METHODS,
        default=None,
        help="Full recompute: uniform (groups of --recompute-num-layers layers) or block (the "
        "first --recompute-num-layers layers).",
    )
    group.add_argument(
        "--recompute-num-layers", type=int, default=None, help="Full recompute: see above."
    )


def recompute_granularity(args: argparse.Namespace) -> str | None:
    """``--recompute-granularity``, or ``selective`` for ``--recompute-activations``."""
    return "selective" if args.recompute_activations else args.recompute_granularity


def _add_fp8_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "FP8",
        "Transformer Engine FP8 GEMMs (Megatron-LM's flags; needs --transformer-impl "
        "transformer_engine).",
    )
    group.add_argument(
        "--fp8-format",
        choices=FP8_FORMATS,
        default=None,
        help="FP8 GEMMs in TE's linears: e4m3 everywhere, or hybrid (e4m3 forward, e5m2 "
        "gradients). Default: off.",
    )
    group.add_argument(
        "--fp8-recipe",
        choices=FP8_RECIPES,
        default="delayed",
        help="Scaling recipe. --domino supports delayed (scales from the amax history, updated "
        "once per micro-batch). Default: delayed.",
    )
    group.add_argument(
        "--fp8-margin", type=int, default=0, help="Scale down by 2**margin. Default: 0."
    )
    group.add_argument(
        "--fp8-amax-history-len",
        type=int,
        default=1,
        help="Steps of amax history for delayed scaling. Default: 1.",
    )
    group.add_argument(
        "--fp8-amax-compute-algo",
        choices=FP8_AMAX_COMPUTE_ALGOS,
        default="most_recent",
        help="Which amax of the history sets the scale. Default: most_recent.",
    )


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data")
    group.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="Dataset prefix(es) of .bin/.idx pairs: PREFIX, or PREFIX1 PREFIX2 ..., or "
        "WEIGHT1 PREFIX1 WEIGHT2 PREFIX2 ... (blended). Exclusive with --mock-data.",
    )
    group.add_argument(
        "--split",
        default="969,30,1",
        help="Train,validation,test proportions of --data-path. Default: 969,30,1.",
    )
    group.add_argument(
        "--mock-data",
        action="store_true",
        help="Train on Megatron-Core's synthetic MockGPTDataset instead of --data-path.",
    )
    group.add_argument(
        "--tokenizer-type",
        choices=TOKENIZER_TYPES,
        required=True,
        help="SentencePieceTokenizer (needs --tokenizer-model) or NullTokenizer (needs "
        "--vocab-size; token ids are used as they are).",
    )
    group.add_argument("--tokenizer-model", default=None, help="SentencePiece model file (.model).")
    group.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="Vocabulary size for NullTokenizer (one more id is added for end-of-document).",
    )
    group.add_argument(
        "--data-cache-path",
        default=None,
        help="Directory for the datasets' sample-index cache. Default: cache/ beside the first "
        f"--data-path prefix, or {MOCK_DATA_CACHE} with --mock-data.",
    )
    group.add_argument(
        "--eod-mask-loss",
        action="store_true",
        help="No loss on the token that follows an end-of-document token.",
    )


def _add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "checkpointing", "megatron.core.dist_checkpointing (torch_dist format)."
    )
    group.add_argument(
        "--save",
        default=None,
        help="Directory to save checkpoints in (model, optimizer, scheduler, iteration, RNG); "
        "a checkpoint is also written after the last iteration.",
    )
    group.add_argument(
        "--save-interval",
        type=int,
        default=None,
        help="Save every N iterations (needs --save).",
    )
    group.add_argument(
        "--load",
        default=None,
        help="Directory to resume from; its latest checkpoint is loaded if it has one, "
        "otherwise training starts from scratch.",
    )
    group.add_argument(
        "--ckpt-step",
        type=int,
        default=None,
        help="Load the checkpoint of this iteration from --load instead of the latest one.",
    )


def _add_logging_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("evaluation and logging")
    group.add_argument(
        "--eval-interval",
        type=int,
        default=None,
        help="Evaluate on the validation split every N iterations and after the last one. "
        "Default: no evaluation.",
    )
    group.add_argument(
        "--eval-iters",
        type=int,
        default=100,
        help="Global batches per evaluation. Default: 100.",
    )
    group.add_argument(
        "--log-interval",
        type=int,
        default=100,
        help="Print a log line every N iterations (timings average over them). Default: 100.",
    )
    group.add_argument(
        "--log-throughput",
        action="store_true",
        help="Add tokens/s and TFLOP/s/GPU (Megatron-LM's GPT FLOP formula) to each log line.",
    )
    group.add_argument(
        "--tensorboard-dir",
        default=None,
        help="Write TensorBoard scalars here (needs the tensorboard package).",
    )
    group.add_argument(
        "--log-json",
        default=None,
        help="Write one JSON object per iteration (loss, lr, grad norm, timings) and per "
        "evaluation to this file, for tests and benchmarks to compare runs; a run resumed "
        "from a checkpoint appends to it.",
    )


#: Iterations ``--domino-report`` records when ``--domino-report-iters`` is not given.
DEFAULT_DOMINO_REPORT_ITERS = 3


def _add_domino_report_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "domino report", "How much tensor-parallel communication Domino hid (needs --domino)."
    )
    group.add_argument(
        "--domino-report",
        action="store_true",
        help="Record Domino's schedule on a few iterations after the first (warm-up) and print, "
        "per layer and direction, the collectives' in-flight time, exposed (blocked-in-wait) "
        "time and hidden fraction, with a WARNING line for every collective that overlapped "
        "no compute (the last of each forward or backward pass excepted: nothing is left to "
        'overlap it). Totals also go to --log-json ("kind": "domino_report"). Other '
        "iterations run without the recorder.",
    )
    group.add_argument(
        "--domino-report-iters",
        type=int,
        default=None,
        metavar="N",
        help="Iterations --domino-report records (needs --domino-report). "
        f"Default: {DEFAULT_DOMINO_REPORT_ITERS}.",
    )


def domino_report_iters(args: argparse.Namespace) -> int:
    """``--domino-report-iters``, defaulting to :data:`DEFAULT_DOMINO_REPORT_ITERS`."""
    if args.domino_report_iters is None:
        return DEFAULT_DOMINO_REPORT_ITERS
    return args.domino_report_iters


@dataclass(frozen=True)
class Layout:
    """How the launched ranks and the batch flags combine; derived, never parsed."""

    world_size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int
    """Gradient-accumulation steps per optimizer step, on every data-parallel rank."""

    @classmethod
    def from_args(cls, args: argparse.Namespace, world_size: int) -> Layout:
        """Raise :class:`ArgumentsError` unless the ranks and batch sizes divide evenly."""
        tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
        if world_size % (tp * pp):
            raise ArgumentsError(
                f"The world size {world_size} is not divisible by "
                f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp}: "
                f"launch a multiple of {tp * pp} processes or change the parallel sizes."
            )
        if args.num_layers % pp:
            raise ArgumentsError(
                f"--num-layers {args.num_layers} is not divisible by "
                f"--pipeline-model-parallel-size {pp}: every stage holds the same number of "
                "layers."
            )
        k = args.recompute_num_layers
        if args.recompute_method == "uniform" and k and (args.num_layers // pp) % k:
            raise ArgumentsError(
                f"--recompute-num-layers {k} does not divide the {args.num_layers // pp} layers "
                "of each pipeline stage: uniform recompute checkpoints groups of that many "
                "layers. Pick a divisor, or --recompute-method block."
            )
        if args.sequence_parallel and tp < 2:
            raise ArgumentsError(
                "--sequence-parallel shards the sequence over the tensor-parallel ranks and "
                "needs --tensor-model-parallel-size > 1; raise it or drop --sequence-parallel."
            )
        dp = world_size // (tp * pp)
        micro = args.micro_batch_size
        global_batch = micro * dp if args.global_batch_size is None else args.global_batch_size
        if global_batch % (micro * dp):
            raise ArgumentsError(
                f"--global-batch-size {global_batch} is not divisible by --micro-batch-size "
                f"{micro} x data-parallel size {dp} (= {world_size} ranks / TP {tp} / PP {pp}): use a "
                f"global batch that is a multiple of {micro * dp}."
            )
        return cls(
            world_size=world_size,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            data_parallel_size=dp,
            micro_batch_size=micro,
            global_batch_size=global_batch,
            num_microbatches=global_batch // (micro * dp),
        )


def model_options(args: argparse.Namespace, *, vocab_size: int) -> GPTOptions:
    """The model the flags describe, for a tokenizer of ``vocab_size`` ids (before padding).

    Raises:
        GPTOptionsError: the shape is invalid (see :class:`GPTOptions`).
    """
    return GPTOptions(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
        vocab_size=vocab_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        max_position_embeddings=args.max_position_embeddings,
        normalization=args.normalization,
        swiglu=args.swiglu,
        position_embedding_type=args.position_embedding_type,
        add_bias_linear=not args.disable_bias_linear,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout,
        init_method_std=args.init_method_std,
        bf16=args.bf16,
        transformer_impl=args.transformer_impl,
        sequence_parallel=args.sequence_parallel,
        recompute_granularity=recompute_granularity(args),
        recompute_modules=tuple(args.recompute_modules or ("core_attn",)),
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        fp8_format=args.fp8_format,
        fp8_recipe=args.fp8_recipe,
        fp8_margin=args.fp8_margin,
        fp8_amax_history_len=args.fp8_amax_history_len,
        fp8_amax_compute_algo=args.fp8_amax_compute_algo,
    )


def tokenizer_from_args(args: argparse.Namespace) -> MegatronTokenizerBase:
    """The tokenizer named by ``--tokenizer-type`` and its model or vocabulary size."""
    return build_tokenizer(
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_size=args.vocab_size,
    )


def lr_decay_iters(args: argparse.Namespace) -> int:
    """``--lr-decay-iters``, defaulting to ``--train-iters`` as in Megatron-LM."""
    return args.train_iters if args.lr_decay_iters is None else args.lr_decay_iters


def data_cache_path(args: argparse.Namespace) -> str:
    """``--data-cache-path``, or ``cache/`` beside the first ``--data-path`` prefix."""
    if args.data_cache_path is not None:
        return args.data_cache_path
    if args.mock_data:
        return MOCK_DATA_CACHE
    prefixes, _ = get_blend_from_list(args.data_path)
    return os.path.join(os.path.dirname(os.path.abspath(prefixes[0])), "cache")


def validate_args(args: argparse.Namespace, *, world_size: int) -> None:
    """Raise :class:`ArgumentsError` for the first invalid flag or combination found.

    Reads the tokenizer (for the vocabulary size the model is checked with) and checks that
    data files exist; writes nothing. Flag combinations are checked before what this machine
    lacks (a GPU, Transformer Engine), so a job script can be checked on any machine.
    """
    _check_positive(args)
    _check_data(args)
    _check_model(args, vocab_size=_tokenizer_vocab_size(args))
    Layout.from_args(args, world_size)
    _check_schedule(args)
    _check_checkpointing(args)
    _check_logging(args)
    _check_domino(args)
    _check_domino_report(args)
    _check_transformer_engine_available(args)


_POSITIVE = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "seq_length",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "micro_batch_size",
    "train_iters",
    "log_interval",
)
_POSITIVE_IF_GIVEN = (
    "global_batch_size",
    "lr_decay_iters",
    "save_interval",
    "eval_interval",
    "ckpt_step",
    "domino_report_iters",
)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _check_positive(args: argparse.Namespace) -> None:
    for dest in _POSITIVE + _POSITIVE_IF_GIVEN:
        value = getattr(args, dest)
        if (value is not None or dest in _POSITIVE) and value < 1:
            raise ArgumentsError(f"{_flag(dest)} must be >= 1, got {value}.")
    for dest in ("lr_warmup_iters", "eval_iters", "weight_decay", "clip_grad", "min_lr"):
        if getattr(args, dest) < 0:
            raise ArgumentsError(f"{_flag(dest)} must be >= 0, got {getattr(args, dest)}.")
    for dest in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(args, dest) < 1:
            raise ArgumentsError(f"{_flag(dest)} must be in [0, 1), got {getattr(args, dest)}.")
    if args.lr <= 0:
        raise ArgumentsError(f"--lr must be > 0, got {args.lr}.")


def _tokenizer_vocab_size(args: argparse.Namespace) -> int:
    try:
        return tokenizer_from_args(args).vocab_size
    except (DataFileError, DataConfigError) as err:
        raise ArgumentsError(str(err)) from err


def _check_model(args: argparse.Namespace, *, vocab_size: int) -> None:
    try:
        options = model_options(args, vocab_size=vocab_size)
        options.check_tensor_parallel(args.tensor_model_parallel_size)
    except GPTOptionsError as err:
        raise ArgumentsError(str(err)) from err


def _check_transformer_engine_available(args: argparse.Namespace) -> None:
    if args.transformer_impl == "transformer_engine" and not (
        torch.cuda.is_available() and _installed("transformer_engine")
    ):
        raise ArgumentsError(
            "--transformer-impl transformer_engine needs a CUDA GPU and Transformer Engine "
            "(`pip install 'megatron-domino[gpu]'`); one of them is missing here. Use "
            "--transformer-impl local."
        )


def _check_schedule(args: argparse.Namespace) -> None:
    if args.min_lr > args.lr:
        raise ArgumentsError(f"--min-lr {args.min_lr} is larger than --lr {args.lr}.")
    decay = lr_decay_iters(args)
    if args.lr_warmup_iters >= decay:
        raise ArgumentsError(
            f"--lr-warmup-iters {args.lr_warmup_iters} must be smaller than the decay length "
            f"{decay} (--lr-decay-iters, default --train-iters)."
        )


def _check_data(args: argparse.Namespace) -> None:
    if args.mock_data == bool(args.data_path):
        raise ArgumentsError(
            "Give exactly one data source: --data-path PREFIX (a .bin/.idx pair made by "
            f"`{PREPARE_COMMAND}`) or --mock-data."
        )
    if args.data_path:
        prefixes, _ = get_blend_from_list(args.data_path)
        for prefix in prefixes:
            for path in (get_bin_path(prefix), get_idx_path(prefix)):
                try:
                    require_readable_file(
                        path,
                        what=f"--data-path {prefix}",
                        fix="Pass the prefix of an indexed dataset (without .bin/.idx), or "
                        f"create one with `{PREPARE_COMMAND}`.",
                    )
                except DataFileError as err:
                    raise ArgumentsError(str(err)) from err
        _check_split(args)


def _check_split(args: argparse.Namespace) -> None:
    try:
        weights = [float(w) for w in args.split.split(",")]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or weights[0] <= 0:
        raise ArgumentsError(
            f"--split {args.split!r} must be up to three comma-separated non-negative "
            "proportions (train,validation,test) with a positive train share, e.g. 969,30,1."
        )
    evaluates = args.eval_interval is not None and args.eval_iters > 0
    if evaluates and (len(weights) < 2 or weights[1] == 0):
        raise ArgumentsError(
            f"--eval-interval needs a validation split, but --split {args.split!r} gives it "
            "no share: use e.g. --split 98,2,0, or drop --eval-interval."
        )


def _check_checkpointing(args: argparse.Namespace) -> None:
    if args.save_interval is not None and args.save is None:
        raise ArgumentsError("--save-interval needs --save DIR to say where checkpoints go.")
    if args.ckpt_step is not None and args.load is None:
        raise ArgumentsError("--ckpt-step needs --load DIR to say where the checkpoint is.")
    if args.save is not None and os.path.exists(args.save) and not os.path.isdir(args.save):
        raise ArgumentsError(f"--save {args.save} exists and is not a directory.")


def _check_logging(args: argparse.Namespace) -> None:
    if args.tensorboard_dir is not None and not _installed("tensorboard"):
        raise ArgumentsError(
            "--tensorboard-dir needs the tensorboard package, which is not installed: "
            "`pip install tensorboard`, or drop the flag (--log-json records every iteration)."
        )


def _check_domino(args: argparse.Namespace) -> None:
    try:
        config = DominoConfig.from_args(args)
        if config is not None:
            config.check_shapes(
                micro_batch_size=args.micro_batch_size,
                hidden_size=args.hidden_size,
                seq_length=args.seq_length,
            )
    except DominoConfigError as err:
        raise ArgumentsError(str(err)) from err
    if config is None:
        return
    if args.tensor_model_parallel_size < 2:
        raise ArgumentsError(
            "--domino hides tensor-parallel communication, and --tensor-model-parallel-size 1 "
            "has none: use TP >= 2 or drop --domino."
        )
    problems = recompute_problems(
        recompute_granularity(args),
        args.recompute_modules or ("core_attn",),
        fp8=args.fp8_format is not None,
    )
    if problems:
        raise ArgumentsError("--domino: " + "; ".join(problems))
    if args.transformer_impl == "transformer_engine":
        fp8_recipe = args.fp8_recipe if args.fp8_format else None
        problems = te_problems(
            config, sequence_parallel=args.sequence_parallel, fp8_recipe=fp8_recipe
        )
        if problems:
            raise ArgumentsError(
                "--domino with --transformer-impl transformer_engine: " + "; ".join(problems)
            )


def _check_domino_report(args: argparse.Namespace) -> None:
    if args.domino_report and not args.domino:
        raise ArgumentsError(
            "--domino-report reports what Domino hid, and --domino is off: add --domino "
            "(the baseline's collectives are Megatron-Core's own and are not recorded)."
        )
    if args.domino_report_iters is not None and not args.domino_report:
        raise ArgumentsError("--domino-report-iters needs --domino-report.")


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None
