"""The tokenizer the data preparation trains: SentencePiece, lossless on any text.

:func:`train_sentencepiece` trains it from a corpus with the settings of
:class:`SentencePieceSettings` (the ``--vocab-size`` ... flags of ``megatron-domino-prepare-data``);
:mod:`megatron_domino.data.prepare` calls it and writes the indexed dataset with the result.
"""

from __future__ import annotations

import io
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import sentencepiece

from megatron_domino.data.corpus import Corpus, CorpusError

__all__ = [
    "MAX_TRAINING_LINE_CHARS",
    "RESERVED_PIECES",
    "Progress",
    "SentencePieceSettings",
    "SettingsError",
    "train_sentencepiece",
]

logger = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 2.0
#: SentencePiece silently skips training sentences longer than ``max_sentence_length`` (4192
#: bytes); lines are cut into pieces of at most this many characters (<= 4 bytes each).
MAX_TRAINING_LINE_CHARS = 1024
#: Pieces every tokenizer here has before it learns any: 256 byte-fallback pieces,
#: ``<unk>``/``<s>``/``</s>`` and the newline symbol.
RESERVED_PIECES = 256 + 3 + 1


class SettingsError(ValueError):
    """An invalid tokenizer-training setting; the message names the flag and the fix."""


@dataclass(frozen=True, kw_only=True)
class SentencePieceSettings:
    """How the tokenizer is trained. Each field is the flag of the same name (``--vocab-size``).

    The options fixed in :func:`train_sentencepiece` (identity normalisation, byte fallback,
    no dummy prefix) are not settings: they are what makes ``decode(encode(text)) == text``.
    """

    vocab_size: int = 8000
    """Pieces in the vocabulary; an upper bound for a corpus too small to fill it."""

    tokenizer_algorithm: str = "bpe"
    """SentencePiece ``model_type``: ``bpe`` (GPT-style, trains in seconds) or ``unigram``."""

    input_sentence_size: int = 300_000
    """Lines sampled (with ``seed``) from the corpus to train on; bounds training time."""

    seed: int = 1234
    """Seed of SentencePiece's line sampling, so that training is reproducible."""

    def __post_init__(self) -> None:
        if self.vocab_size <= RESERVED_PIECES:
            raise SettingsError(
                f"--vocab-size {self.vocab_size} is too small: {RESERVED_PIECES} pieces are "
                "reserved (256 bytes, <unk>, <s>, </s>, newline); use a few hundred or more."
            )
        if self.tokenizer_algorithm not in ("bpe", "unigram"):
            raise SettingsError(
                f"--tokenizer-algorithm must be 'bpe' or 'unigram', got {self.tokenizer_algorithm!r}."
            )
        if self.input_sentence_size <= 0:
            raise SettingsError(
                f"--input-sentence-size must be positive, got {self.input_sentence_size}."
            )


class Progress:
    """Logs a running count at most every :data:`PROGRESS_INTERVAL_S` seconds."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.start = self.last = time.monotonic()

    def update(self, message: str, *, final: bool = False) -> None:
        now = time.monotonic()
        if final or now - self.last >= PROGRESS_INTERVAL_S:
            self.last = now
            logger.info("%s: %s (%.1f s)", self.what, message, now - self.start)


def train_sentencepiece(
    *,
    corpus: Corpus,
    output_model: str | os.PathLike,
    settings: SentencePieceSettings,
    num_threads: int,
) -> None:
    """Train a SentencePiece model whose decoding reproduces the text exactly.

    Training reads lines, not documents, because SentencePiece skips sentences over 4192
    bytes; a newline is a user-defined piece, so encoding a whole document keeps one token per
    line break. Identity normalisation, kept whitespace and no dummy prefix leave the text
    unchanged; byte fallback spells any unseen character as UTF-8 bytes instead of ``<unk>``.
    """
    reading_error: list[Exception] = []
    text_lines = 0

    def lines() -> Iterator[str]:
        # SentencePiece turns an exception raised by the iterator into a RuntimeError; keep
        # the original (e.g. a CorpusError naming the bad line) to re-raise it.
        nonlocal text_lines
        try:
            for line in _training_lines(corpus):
                text_lines += bool(line.strip())
                yield line
        except Exception as err:
            reading_error.append(err)
            raise

    model = io.BytesIO()
    sentencepiece.set_random_generator_seed(settings.seed)
    logger.info(
        "training a %d-piece %s tokenizer on up to %d sampled lines",
        settings.vocab_size,
        settings.tokenizer_algorithm,
        settings.input_sentence_size,
    )
    started = time.monotonic()
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=lines(),
            model_writer=model,
            vocab_size=settings.vocab_size,
            model_type=settings.tokenizer_algorithm,
            input_sentence_size=settings.input_sentence_size,
            shuffle_input_sentence=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            byte_fallback=True,
            user_defined_symbols=["\n"],
            allow_whitespace_only_pieces=True,
            split_digits=True,
            hard_vocab_limit=False,
            num_threads=num_threads,
            minloglevel=1,
        )
    except RuntimeError as err:
        if reading_error:
            raise reading_error[0] from None
        if not text_lines:  # SentencePiece says only "[!sentences_.empty()]"
            raise CorpusError(
                f"{corpus.description}: no text to train a tokenizer on (every document is "
                "empty or blank); pass files that hold text."
            ) from None
        raise SettingsError(f"SentencePiece cannot train with {settings}: {err}") from err
    Path(output_model).write_bytes(model.getvalue())
    logger.info("trained the tokenizer in %.1f s", time.monotonic() - started)


def _training_lines(corpus: Corpus) -> Iterator[str]:
    progress = Progress("reading lines for tokenizer training")
    num_documents = num_lines = 0
    for document in corpus:
        num_documents += 1
        for line in document.splitlines():
            for start in range(0, len(line), MAX_TRAINING_LINE_CHARS):
                num_lines += 1
                yield line[start : start + MAX_TRAINING_LINE_CHARS]
        progress.update(f"{num_documents:,} documents, {num_lines:,} lines")
    progress.update(f"{num_documents:,} documents, {num_lines:,} lines", final=True)
