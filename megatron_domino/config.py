"""Domino's configuration: one validated object, and the command-line flags generated from it.

The flags map 1:1 onto the fields of :class:`DominoConfig` (``--domino-chunks`` is
``chunks``, ``--no-domino-inter-layer`` clears ``inter_layer``, ...), so the parser, the
README and the object cannot drift apart: :func:`add_domino_args` walks the dataclass fields.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field


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
            "help": "p: split each layer's input into p chunks along --domino-split; must "
            "divide --micro-batch-size (batch) or --seq-length (sequence).",
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
        if self.chunks == 1 and self.column_chunks == 1:
            raise DominoConfigError(
                "--domino-chunks 1 with --domino-column-chunks 1 leaves nothing to overlap: "
                "use --domino-chunks >= 2 (micro-batch >= 2) or --domino-column-chunks >= 2."
            )

    def check_shapes(
        self,
        *,
        micro_batch_size: int,
        hidden_size: int,
        seq_length: int | None = None,
        sequence_parallel_size: int = 1,
    ) -> None:
        """Raise :class:`DominoConfigError` unless the model's shapes can be split as asked.

        ``seq_length`` is checked for the sequence split when given (else at the first step);
        under sequence parallelism (``sequence_parallel_size``, the TP size) every rank holds
        an equal piece of every chunk, so ``p * TP`` must divide it.
        """
        if self.split_along == "sequence":
            pieces = self.chunks * sequence_parallel_size
            if seq_length is not None and seq_length % pieces:
                under_sp = (
                    f" x --tensor-model-parallel-size {sequence_parallel_size} (under "
                    "--sequence-parallel every rank holds an equal piece of every chunk)"
                    if sequence_parallel_size > 1
                    else ""
                )
                raise DominoConfigError(
                    f"--seq-length {seq_length} is not divisible by --domino-chunks "
                    f"{self.chunks}{under_sp}: with --domino-split sequence each chunk holds the "
                    "same number of tokens. Pick a chunk count that divides the sequence length."
                )
        elif micro_batch_size % self.chunks:
            raise DominoConfigError(
                f"--micro-batch-size {micro_batch_size} is not divisible by --domino-chunks "
                f"{self.chunks}: each chunk must hold the same number of samples. Pick a "
                "micro-batch that is a multiple of the chunk count, or at micro-batch 1 use "
                "--domino-split sequence (or --domino-chunks 1 with --domino-column-chunks >= 2)."
            )
        if hidden_size % self.column_chunks:
            raise DominoConfigError(
                f"--hidden-size {hidden_size} is not divisible by --domino-column-chunks "
                f"{self.column_chunks}."
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DominoConfig | None:
        """The config described by parsed flags, or ``None`` when ``--domino`` is off."""
        if not args.domino:
            return None
        return cls(**{f.name: getattr(args, _dest(f)) for f in _fields()})


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
                type=int,
                default=f.default,
                metavar="N",
                help=meta["help"] + f" Default: {f.default}.",
            )
    return parser
