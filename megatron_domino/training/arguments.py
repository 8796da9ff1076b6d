"""Command-line flags of ``pretrain_gpt_domino.py``, with Megatron-LM's names and meanings.

The parsed :class:`argparse.Namespace` is the run's one configuration object: it is validated
as a whole right after parsing (before anything is written or any process group exists), and
never modified afterwards. Quantities that follow from several flags and the launch (data
parallel size, gradient-accumulation steps, ...) are computed by :class:`Layout` and the small
functions below instead of being written back into the namespace, so a printed namespace is
always exactly what the user asked for.

Only the subset of Megatron-LM's flags that this trainer implements is accepted; an unknown
Megatron flag is an argparse error rather than being silently ignored.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
from dataclasses import dataclass

from megatron.core.datasets.utils import get_blend_from_list

from megatron_domino.config import DominoConfig, DominoConfigError, add_domino_args


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
    _add_data_args(parser)
    _add_checkpoint_args(parser)
    _add_logging_args(parser)
    add_domino_args(parser)
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
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="Pad the vocabulary to a multiple of this times the tensor-parallel size, so the "
        "output layer splits evenly. Default: 128.",
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
        help="Tensor-parallel ranks per model replica; data-parallel size = world size / this.",
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
        choices=("SentencePieceTokenizer", "NullTokenizer"),
        default=None,
        help="SentencePieceTokenizer (needs --tokenizer-model) or NullTokenizer (needs "
        "--vocab-size; token ids are used as they are). Required.",
    )
    group.add_argument("--tokenizer-model", default=None, help="SentencePiece model file (.model).")
    group.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="Vocabulary size for NullTokenizer (one more id is added for end-of-document).",
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
        help="Append one JSON object per iteration (loss, lr, grad norm, timings) and per "
        "evaluation to this file, for tests and benchmarks to compare runs.",
    )


@dataclass(frozen=True)
class Layout:
    """How the launched ranks and the batch flags combine; derived, never parsed."""

    world_size: int
    tensor_parallel_size: int
    data_parallel_size: int
    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int
    """Gradient-accumulation steps per optimizer step, on every data-parallel rank."""

    @classmethod
    def from_args(cls, args: argparse.Namespace, world_size: int) -> Layout:
        """Raise :class:`ArgumentsError` unless the ranks and batch sizes divide evenly."""
        tp = args.tensor_model_parallel_size
        if world_size % tp:
            raise ArgumentsError(
                f"The world size {world_size} is not divisible by "
                f"--tensor-model-parallel-size {tp}: launch a multiple of {tp} processes or "
                "change the tensor-parallel size."
            )
        dp = world_size // tp
        micro = args.micro_batch_size
        global_batch = micro * dp if args.global_batch_size is None else args.global_batch_size
        if global_batch % (micro * dp):
            raise ArgumentsError(
                f"--global-batch-size {global_batch} is not divisible by --micro-batch-size "
                f"{micro} x data-parallel size {dp} (= {world_size} ranks / TP {tp}): use a "
                f"global batch that is a multiple of {micro * dp}."
            )
        return cls(
            world_size=world_size,
            tensor_parallel_size=tp,
            data_parallel_size=dp,
            micro_batch_size=micro,
            global_batch_size=global_batch,
            num_microbatches=global_batch // (micro * dp),
        )


def ffn_hidden_size(args: argparse.Namespace) -> int:
    """``--ffn-hidden-size``, or Megatron-LM's default for it (see the flag's help)."""
    if args.ffn_hidden_size is not None:
        return args.ffn_hidden_size
    if args.swiglu:
        return int(4 * args.hidden_size * 2 / 3 / 64) * 64
    return 4 * args.hidden_size


def num_query_groups(args: argparse.Namespace) -> int:
    """Key/value heads: ``--num-query-groups`` under grouped-query attention, else every head."""
    return args.num_query_groups if args.group_query_attention else args.num_attention_heads


def max_position_embeddings(args: argparse.Namespace) -> int:
    """``--max-position-embeddings``, defaulting to ``--seq-length`` as in Megatron-LM."""
    if args.max_position_embeddings is None:
        return args.seq_length
    return args.max_position_embeddings


def lr_decay_iters(args: argparse.Namespace) -> int:
    """``--lr-decay-iters``, defaulting to ``--train-iters`` as in Megatron-LM."""
    return args.train_iters if args.lr_decay_iters is None else args.lr_decay_iters


def padded_vocab_size(vocab_size: int, args: argparse.Namespace) -> int:
    """The tokenizer's vocabulary padded as Megatron-LM pads it, so every TP shard is equal.

    The output layer's (and embedding's) rows are split over tensor-parallel ranks, so the
    size is rounded up to a multiple of ``--make-vocab-size-divisible-by`` x TP.
    """
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return math.ceil(vocab_size / multiple) * multiple


def validate_args(args: argparse.Namespace, *, world_size: int) -> None:
    """Raise :class:`ArgumentsError` for the first invalid flag or combination found."""
    _check_positive(args)
    _check_model(args)
    Layout.from_args(args, world_size)
    _check_schedule(args)
    _check_data(args)
    _check_checkpointing(args)
    _check_logging(args)
    _check_domino(args)


_POSITIVE = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "seq_length",
    "tensor_model_parallel_size",
    "micro_batch_size",
    "train_iters",
    "make_vocab_size_divisible_by",
    "log_interval",
)
_POSITIVE_IF_GIVEN = (
    "ffn_hidden_size",
    "max_position_embeddings",
    "global_batch_size",
    "lr_decay_iters",
    "save_interval",
    "eval_interval",
    "vocab_size",
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
    for dest in ("attention_dropout", "hidden_dropout", "adam_beta1", "adam_beta2"):
        if not 0 <= getattr(args, dest) < 1:
            raise ArgumentsError(f"{_flag(dest)} must be in [0, 1), got {getattr(args, dest)}.")
    if args.lr <= 0:
        raise ArgumentsError(f"--lr must be > 0, got {args.lr}.")


def _check_model(args: argparse.Namespace) -> None:
    tp = args.tensor_model_parallel_size
    heads = args.num_attention_heads
    if args.hidden_size % heads:
        raise ArgumentsError(
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {heads}: "
            "every head must have the same width."
        )
    if heads % tp:
        raise ArgumentsError(
            f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size "
            f"{tp}: each TP rank holds whole heads. Pick a head count that is a multiple of {tp}."
        )
    groups = num_query_groups(args)
    if heads % groups:
        raise ArgumentsError(
            f"--num-attention-heads {heads} is not divisible by --num-query-groups {groups}: "
            "each key/value head must serve the same number of query heads."
        )
    if groups % tp:
        raise ArgumentsError(
            f"--num-query-groups {groups} is not divisible by --tensor-model-parallel-size {tp}: "
            f"each TP rank holds whole key/value heads. Use a multiple of {tp} query groups."
        )
    if ffn_hidden_size(args) % tp:
        raise ArgumentsError(
            f"The MLP hidden size {ffn_hidden_size(args)} is not divisible by "
            f"--tensor-model-parallel-size {tp}; set --ffn-hidden-size to a multiple of {tp}."
        )
    if (
        args.position_embedding_type == "learned_absolute"
        and max_position_embeddings(args) < args.seq_length
    ):
        raise ArgumentsError(
            f"--max-position-embeddings {args.max_position_embeddings} is smaller than "
            f"--seq-length {args.seq_length}: the learned position table needs a row per "
            "position. Raise it or drop the flag."
        )
    if args.transformer_impl == "transformer_engine" and not _installed("transformer_engine"):
        raise ArgumentsError(
            "--transformer-impl transformer_engine needs Transformer Engine, which is not "
            "installed: install it (`pip install 'megatron-domino[gpu]'`, GPU only) or use "
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
            "Give exactly one data source: --data-path PREFIX (a .bin/.idx pair, e.g. made by "
            "`python -m megatron_domino.data.prepare`) or --mock-data."
        )
    if args.data_path:
        prefixes, _ = get_blend_from_list(args.data_path)
        for prefix in prefixes:
            missing = [p for p in (prefix + ".bin", prefix + ".idx") if not os.path.isfile(p)]
            if missing:
                raise ArgumentsError(
                    f"--data-path {prefix}: {', '.join(missing)} not found. Pass the prefix "
                    "of an indexed dataset (without .bin/.idx), or prepare one with "
                    "`python -m megatron_domino.data.prepare`."
                )
        _check_split(args)
    if args.tokenizer_type is None:
        raise ArgumentsError(
            "--tokenizer-type is required: SentencePieceTokenizer with --tokenizer-model, or "
            "NullTokenizer with --vocab-size."
        )
    if args.tokenizer_type == "SentencePieceTokenizer":
        if args.tokenizer_model is None or not os.path.isfile(args.tokenizer_model):
            raise ArgumentsError(
                f"--tokenizer-type SentencePieceTokenizer needs --tokenizer-model pointing to a "
                f"SentencePiece .model file; got {args.tokenizer_model!r}."
            )
    elif args.vocab_size is None:
        raise ArgumentsError("--tokenizer-type NullTokenizer needs --vocab-size.")


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
                micro_batch_size=args.micro_batch_size, hidden_size=args.hidden_size
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
    if args.transformer_impl != "local":
        raise ArgumentsError(
            "--domino re-sequences Megatron-Core's own layers; under --transformer-impl "
            "transformer_engine, TE's linears run the collectives. Use --transformer-impl local."
        )


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None
