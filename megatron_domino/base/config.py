"""Domino's configuration: one validated object, and the command-line flags generated from it.

The flags map 1:1 onto the fields of :class:`DominoConfig` (``--domino-chunks`` is
``chunks``, ``--no-domino-inter-layer`` clears ``inter_layer``, ...), so the parser, the
README and the object cannot drift apart: :func:`add_domino_args` walks the dataclass fields.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

#: ``--domino-chunks auto``: the setting is chosen by timing candidates on the run's first
#: iterations (:mod:`megatron_domino.autotune`); a :class:`DominoConfig` always holds numbers.
AUTO = "auto"


class DominoConfigError(ValueError):
    """An invalid Domino setting; the message names the setting and the fix."""


class DominoUnsupportedError(RuntimeError):
    """A model feature Domino cannot run with; the message names it and what to do instead."""


@dataclass(frozen=True, kw_only=True)
class DominoConfig:
    """How Domino slices each transformer layer's work to hide tensor-parallel collectives.

    A layer's input ``[s, b, h]`` is split along ``b`` into ``chunks`` row chunks of
    ``[s, b/p, h]`` (or, with ``split_along="sequence"``, along ``s`` into ``[s/p, b, h]``); each
    row-parallel GEMM (attention output projection, MLP fc2) is further split along its output
    dimension ``h`` into ``column_chunks`` pieces of width ``h/k``. Every chunk and piece
    launches its own all-reduce, which flies while another chunk or piece computes.
    """

    chunks: int = field(
        default=2,
        metadata={
            "flag": "--domino-chunks",
            "auto": True,
            "help": "p: split each layer's input into p chunks along --domino-split; must "
            "divide --micro-batch-size (batch) or --seq-length (sequence). 'auto' (with "
            "pretrain_gpt_domino.py) chooses p, --domino-column-chunks and --domino-split "
            "together by timing each candidate on the first iterations of the run.",
        },
    )
    column_chunks: int = field(
        default=1,
        metadata={
            "flag": "--domino-column-chunks",
            "help": "k: split the output dimension h of each row-parallel GEMM into k pieces "
            "whose all-reduces overlap the next piece's GEMM; works at micro-batch 1 and "
            "combines with --domino-chunks; must divide --hidden-size.",
        },
    )
    split_along: str = field(
        default="batch",
        metadata={
            "flag": "--domino-split",
            "choices": ("batch", "sequence"),
            "help": "What the chunks split: batch (samples; independent chunks, needs a "
            "micro-batch of at least p) or sequence (token ranges; chunk j attends to the keys "
            "of chunks <= j, so it works at micro-batch 1; causal attention, local or "
            "Transformer Engine layers, with or without --sequence-parallel).",
        },
    )
    inter_layer: bool = field(
        default=True,
        metadata={
            "flag": "--no-domino-inter-layer",
            "help": "Wait for the last chunk's MLP all-reduce at the end of each layer instead "
            "of leaving it in flight into the next layer (ablation).",
        },
    )
    backward_overlap: bool = field(
        default=True,
        metadata={
            "flag": "--no-domino-backward-overlap",
            "help": "Keep Megatron-Core's backward: each column-parallel linear waits for its "
            "input-gradient all-reduce before returning (ablation).",
        },
    )
    backward_order: str = field(
        default="legs",
        metadata={
            "flag": "--domino-backward-order",
            "choices": ("legs", "autograd", "serial"),
            "help": "How the backward interleaves the chunks. legs: each chunk's work between "
            "two collectives is one leg, and the legs run in an order Domino chooses, so that "
            "another chunk's whole leg runs while each backward collective flies, and the "
            "forward launches its all-reduces before it waits (the default). autograd: the "
            "order autograd derives from the forward's (ablation; the forward then keeps the "
            "chunk order within a step). serial: each chunk's legs back to back, nothing hidden "
            "in backward (a negative control for measurements).",
        },
    )

    def __post_init__(self) -> None:
        for name in ("chunks", "column_chunks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                flag = _field(name).metadata["flag"]
                raise DominoConfigError(f"{flag} must be an integer >= 1, got {value!r}.")
        choices = _field("split_along").metadata["choices"]
        if self.split_along not in choices:
            raise DominoConfigError(
                f"--domino-split must be one of {', '.join(choices)}, got {self.split_along!r}."
            )
        orders = _field("backward_order").metadata["choices"]
        if self.backward_order not in orders:
            raise DominoConfigError(
                f"--domino-backward-order must be one of {', '.join(orders)}, got "
                f"{self.backward_order!r}."
            )
        if self.chunks == 1 and self.column_chunks == 1:
            raise DominoConfigError(
                "--domino-chunks 1 with --domino-column-chunks 1 leaves nothing to overlap: "
                "use --domino-chunks >= 2 (micro-batch >= 2) or --domino-column-chunks >= 2."
            )

    def shape_problems(
        self,
        *,
        micro_batch_size: int | None = None,
        hidden_size: int | None = None,
        seq_length: int | None = None,
        sequence_parallel_size: int = 1,
    ) -> list[str]:
        """Why the model's shapes cannot be split as asked (empty when they can).

        The one place that says which dimension each setting must divide; a shape left at
        ``None`` is not known yet and not checked. The flags are checked when parsed
        (:meth:`check_shapes`), the model when Domino is applied (``hidden_size``), and the
        chunks' shapes when the block splits its input (:mod:`megatron_domino.engine.chunking`).
        Under sequence parallelism (``sequence_parallel_size``, the TP size) every rank holds
        an equal piece of every chunk, so ``p * TP`` must divide ``seq_length``.
        """
        problems = []
        if self.split_along == "sequence":
            pieces = self.chunks * sequence_parallel_size
            if seq_length is not None and seq_length % pieces:
                under_sp = (
                    f" x --tensor-model-parallel-size {sequence_parallel_size} (under "
                    "--sequence-parallel every rank holds an equal piece of every chunk)"
                    if sequence_parallel_size > 1
                    else ""
                )
                problems.append(
                    f"--seq-length {seq_length} is not divisible by --domino-chunks "
                    f"{self.chunks}{under_sp}: with --domino-split sequence each chunk holds the "
                    "same number of tokens. Pick a chunk count that divides the sequence length."
                )
        elif micro_batch_size is not None and micro_batch_size % self.chunks:
            problems.append(
                f"--micro-batch-size {micro_batch_size} is not divisible by --domino-chunks "
                f"{self.chunks}: each chunk must hold the same number of samples. Pick a "
                "micro-batch that is a multiple of the chunk count, or at micro-batch 1 use "
                "--domino-split sequence (or --domino-chunks 1 with --domino-column-chunks >= 2)."
            )
        if hidden_size is not None and hidden_size % self.column_chunks:
            problems.append(
                f"--hidden-size {hidden_size} is not divisible by --domino-column-chunks "
                f"{self.column_chunks}."
            )
        return problems

    def check_shapes(self, **shapes) -> None:
        """Raise :class:`DominoConfigError` unless the shapes can be split as asked.

        Takes the keyword arguments of :meth:`shape_problems`; the message is the first
        problem found.
        """
        problems = self.shape_problems(**shapes)
        if problems:
            raise DominoConfigError(problems[0])

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DominoConfig | None:
        """The config described by parsed flags, or ``None`` when ``--domino`` is off.

        Raises:
            DominoConfigError: ``--domino-chunks auto`` (no single config: see
                :func:`megatron_domino.training.megatron_lm.check_args`), or an invalid value.
        """
        if not args.domino:
            return None
        if args.domino_chunks == AUTO:
            raise DominoConfigError(
                "--domino-chunks auto describes candidates, not one setting; "
                "megatron_domino.training.megatron_lm.check_args builds the tuner for it."
            )
        return cls(**{f.name: getattr(args, _dest(f)) for f in _fields()})

    @staticmethod
    def auto_fields(args: argparse.Namespace) -> dict:
        """With ``--domino-chunks auto``: the fields the tuner keeps fixed (the ablation
        switches). The tuner chooses the split and the column chunks, so setting those too
        is an error rather than something silently ignored."""
        tuned = ("chunks", "column_chunks", "split_along")
        for name in tuned[1:]:
            f = _field(name)
            if getattr(args, _dest(f)) != f.default:
                raise DominoConfigError(
                    f"--domino-chunks auto chooses {f.metadata['flag']} too; drop "
                    f"{f.metadata['flag']} {getattr(args, _dest(f))}, or give --domino-chunks "
                    "a number."
                )
        return {f.name: getattr(args, _dest(f)) for f in _fields() if f.name not in tuned}


def _dest(f: dataclasses.Field) -> str:
    """Where a field's flag is stored in the parsed namespace: ``domino_<field>``, so that
    Domino's values never collide with Megatron-LM's own arguments on a shared parser."""
    return f"domino_{f.name}"


def _fields() -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(DominoConfig)


def _field(name: str) -> dataclasses.Field:
    return next(f for f in _fields() if f.name == name)


def add_domino_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--domino`` and one flag per :class:`DominoConfig` field to ``parser``.

    Integer fields become ``--domino-<name> N``, fields with choices ``--domino-<name>
    CHOICE``; boolean fields that default to True become ``--no-domino-<name>`` switches. Values are validated when :meth:`DominoConfig.from_args`
    builds the config, so an invalid value fails at start-up, not mid-run.
    """
    group = parser.add_argument_group("domino", "Hide tensor-parallel communication (Domino).")
    group.add_argument(
        "--domino",
        action="store_true",
        help="Overlap every tensor-parallel collective with computation (needs TP > 1).",
    )
    for f in _fields():
        meta = f.metadata
        if isinstance(f.default, bool):
            group.add_argument(
                meta["flag"],
                dest=_dest(f),
                action="store_false",
                default=f.default,
                help=meta["help"],
            )
        elif "choices" in meta:
            group.add_argument(
                meta["flag"],
                dest=_dest(f),
                choices=meta["choices"],
                default=f.default,
                help=meta["help"] + f" Default: {f.default}.",
            )
        else:
            group.add_argument(
                meta["flag"],
                dest=_dest(f),
                type=_int_or_auto if meta.get("auto") else int,
                default=f.default,
                metavar="N|auto" if meta.get("auto") else "N",
                help=meta["help"] + f" Default: {f.default}.",
            )
    return parser


def _int_or_auto(value: str) -> int | str:
    """``--domino-chunks``'s type: a number, or :data:`AUTO`."""
    if value == AUTO:
        return AUTO
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {value!r}") from None
