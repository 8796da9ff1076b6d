"""Turn a corpus into what Megatron-Core trains on: a SentencePiece model and a .bin/.idx pair.

One output folder holds ``tokenizer.model``, ``text_document.bin``/``.idx`` (written with
Megatron-Core's ``IndexedDatasetBuilder``: one sequence per input document, each ending with the
end-of-document token) and ``manifest.json``. The manifest records a digest of the inputs and
settings; a re-run with the same digest reuses the outputs, anything else rebuilds them. Outputs
are staged and published only when complete (:func:`~megatron_domino.data.files.staged_outputs`).

Command line::

    python -m megatron_domino.data.prepare --stdlib-corpus --output-dir data_cache/stdlib
    python -m megatron_domino.data.prepare --input docs.jsonl --json-key text --output-dir DIR

then train with ``--data-path DIR/text_document --tokenizer-model DIR/tokenizer.model``.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy
import sentencepiece
from megatron.core.datasets.indexed_dataset import (
    DType,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)

from megatron_domino.data.checks import check_sentencepiece_model
from megatron_domino.data.corpus import (
    STDLIB_DEFAULT_MAX_BYTES,
    Corpus,
    CorpusError,
    file_corpus,
    stdlib_corpus,
)
from megatron_domino.data.files import (
    DataFileError,
    content_digest,
    digest,
    staged_outputs,
)

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.model"
DATA_PREFIX_NAME = "text_document"
MANIFEST_FILE = "manifest.json"
#: Bump when the output layout or the tokenisation changes, so old caches are rebuilt.
MANIFEST_FORMAT = 1

#: SentencePiece silently skips training sentences longer than ``max_sentence_length`` (4192
#: bytes); lines are cut into pieces of at most this many characters (<= 4 bytes each).
MAX_TRAINING_LINE_CHARS = 1024
#: Pieces every tokenizer here has before it learns any: 256 byte-fallback pieces,
#: ``<unk>``/``<s>``/``</s>`` and the newline symbol.
RESERVED_PIECES = 256 + 3 + 1
#: Documents handed to SentencePiece per multi-threaded encode call.
ENCODE_BATCH_DOCUMENTS = 256
PROGRESS_INTERVAL_S = 2.0


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


@dataclass(frozen=True, kw_only=True)
class PreparedData:
    """What :func:`prepare` produced; ``data_prefix`` and ``tokenizer_model`` are the values for
    ``--data-path`` and ``--tokenizer-model``."""

    output_dir: Path
    tokenizer_model: Path
    data_prefix: str
    num_documents: int
    num_tokens: int
    vocab_size: int
    eod: int
    reused: bool
    """True when the outputs of an earlier run with the same inputs and settings were kept."""


class _Progress:
    """Logs a running count at most every :data:`PROGRESS_INTERVAL_S` seconds."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.start = self.last = time.monotonic()

    def update(self, message: str, *, final: bool = False) -> None:
        now = time.monotonic()
        if final or now - self.last >= PROGRESS_INTERVAL_S:
            self.last = now
            logger.info("%s: %s (%.1f s)", self.what, message, now - self.start)


def prepare(
    *,
    corpus: Corpus,
    output_dir: str | os.PathLike,
    tokenizer_model: str | os.PathLike | None = None,
    settings: SentencePieceSettings | None = None,
    num_threads: int | None = None,
    force: bool = False,
) -> PreparedData:
    """Train (or copy) a tokenizer and tokenise ``corpus`` into ``output_dir``, or reuse both.

    Args:
        corpus: the documents, from :func:`~megatron_domino.data.corpus.file_corpus` or
            :func:`~megatron_domino.data.corpus.stdlib_corpus`.
        output_dir: where ``tokenizer.model``, ``text_document.bin/.idx`` and the manifest go.
        tokenizer_model: an existing SentencePiece model to use instead of training one (e.g.
            to tokenise a second corpus for a blend with the same vocabulary); it is copied.
        settings: tokenizer training settings (ignored with ``tokenizer_model``); the
            defaults of :class:`SentencePieceSettings` if not given.
        num_threads: threads for SentencePiece training and encoding; all CPUs by default.
        force: rebuild even if the manifest says the outputs are current.

    Call it from one process (e.g. rank 0, then a barrier): two runs publishing into the same
    folder at once each stay consistent, but a reader may briefly find no manifest.
    """
    output_dir = Path(output_dir)
    settings = settings or SentencePieceSettings()
    num_threads = num_threads or os.cpu_count() or 1
    if tokenizer_model is not None:
        tokenizer_model = check_sentencepiece_model(
            tokenizer_model,
            what="--tokenizer-model",
            fix="Pass a SentencePiece .model file, or leave the flag out to train one.",
        )
        tokenizer_source = {"model_sha256": content_digest(tokenizer_model)}
    else:
        tokenizer_source = {"train": dataclasses.asdict(settings)}
    key = digest(
        {"format": MANIFEST_FORMAT, "corpus": corpus.fingerprint, "tokenizer": tokenizer_source}
    )
    manifest = None if force else _current_manifest(output_dir, key)
    if manifest is not None:
        logger.info("reusing %s (inputs and settings unchanged)", output_dir)
        return _prepared(output_dir, manifest, reused=True)

    logger.info("preparing %s from %s", output_dir, corpus.description)
    with staged_outputs(output_dir, commit_marker=MANIFEST_FILE) as staging:
        model_path = staging / TOKENIZER_FILE
        if tokenizer_model is not None:
            shutil.copyfile(tokenizer_model, model_path)
        else:
            train_sentencepiece(
                corpus=corpus, output_model=model_path, settings=settings, num_threads=num_threads
            )
        stats = write_indexed_dataset(
            corpus=corpus,
            tokenizer_model=model_path,
            output_prefix=staging / DATA_PREFIX_NAME,
            num_threads=num_threads,
        )
        manifest = {
            "format": MANIFEST_FORMAT,
            "key": key,
            "corpus": corpus.description,
            "tokenizer": tokenizer_source,
            **stats,
            "file_sizes": {path.name: path.stat().st_size for path in sorted(staging.iterdir())},
        }
        (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return _prepared(output_dir, manifest, reused=False)


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


def write_indexed_dataset(
    *,
    corpus: Corpus,
    tokenizer_model: str | os.PathLike,
    output_prefix: str | os.PathLike,
    num_threads: int,
) -> dict[str, int]:
    """Tokenise every non-empty document into ``output_prefix.bin/.idx``, EOD appended.

    The end-of-document token is the model's ``</s>`` (``eos_id``): that is what
    ``megatron.core.tokenizers``' SentencePiece tokenizer reports as ``eod``, so GPTDataset's
    loss and position masks find the boundaries written here. Tokens are stored as uint16 when
    the vocabulary allows (Megatron's ``DType.optimal_dtype``).

    Returns:
        ``num_documents``, ``num_tokens`` (EOD included), ``vocab_size`` and ``eod``.
    """
    processor = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_model))
    eod, vocab_size = processor.eos_id(), processor.get_piece_size()
    if eod < 0:
        raise SettingsError(
            f"{tokenizer_model} has no </s> piece (eos_id = -1); Megatron needs it as the "
            "end-of-document token. Train the tokenizer with this command instead."
        )
    dtype = DType.optimal_dtype(vocab_size)
    builder = IndexedDatasetBuilder(get_bin_path(str(output_prefix)), dtype=dtype)
    progress = _Progress("tokenising")
    num_documents = num_tokens = num_empty = 0
    for batch in _batches(iter(corpus), ENCODE_BATCH_DOCUMENTS):
        for ids in processor.encode(batch, num_threads=num_threads):
            if not ids:
                num_empty += 1
                continue
            ids.append(eod)
            builder.add_document(numpy.asarray(ids, dtype=dtype), lengths=[len(ids)])
            num_documents += 1
            num_tokens += len(ids)
        progress.update(f"{num_documents:,} documents, {num_tokens:,} tokens")
    builder.finalize(get_idx_path(str(output_prefix)))
    progress.update(
        f"{num_documents:,} documents, {num_tokens:,} tokens, {num_empty} empty skipped",
        final=True,
    )
    if num_documents == 0:
        raise CorpusError(
            f"{corpus.description}: no non-empty documents, nothing to train on; pass files "
            "that hold text."
        )
    return {
        "num_documents": num_documents,
        "num_tokens": num_tokens,
        "vocab_size": vocab_size,
        "eod": eod,
    }


def _training_lines(corpus: Corpus) -> Iterator[str]:
    progress = _Progress("reading lines for tokenizer training")
    num_documents = num_lines = 0
    for document in corpus:
        num_documents += 1
        for line in document.splitlines():
            for start in range(0, len(line), MAX_TRAINING_LINE_CHARS):
                num_lines += 1
                yield line[start : start + MAX_TRAINING_LINE_CHARS]
        progress.update(f"{num_documents:,} documents, {num_lines:,} lines")
    progress.update(f"{num_documents:,} documents, {num_lines:,} lines", final=True)


def _batches(items: Iterator[str], size: int) -> Iterator[list[str]]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _current_manifest(output_dir: Path, key: str) -> dict | None:
    """The manifest in ``output_dir`` if it has ``key`` and every file it lists is intact."""
    try:
        manifest = json.loads((output_dir / MANIFEST_FILE).read_text())
        intact = all(
            (output_dir / name).stat().st_size == size
            for name, size in manifest["file_sizes"].items()
        )
    except (OSError, ValueError, KeyError, AttributeError):
        return None
    return manifest if intact and manifest.get("key") == key else None


def _prepared(output_dir: Path, manifest: dict, *, reused: bool) -> PreparedData:
    return PreparedData(
        output_dir=output_dir,
        tokenizer_model=output_dir / TOKENIZER_FILE,
        data_prefix=str(output_dir / DATA_PREFIX_NAME),
        num_documents=manifest["num_documents"],
        num_tokens=manifest["num_tokens"],
        vocab_size=manifest["vocab_size"],
        eod=manifest["eod"],
        reused=reused,
    )


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface; tokenizer flags map 1:1 onto :class:`SentencePieceSettings`."""
    defaults = SentencePieceSettings()
    parser = argparse.ArgumentParser(
        prog="python -m megatron_domino.data.prepare",
        description="Train a SentencePiece tokenizer and write a Megatron indexed dataset "
        "(.bin/.idx) from text/JSONL files or from the Python standard library. Re-running with "
        "unchanged inputs and settings reuses the outputs.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--input",
        nargs="+",
        metavar="FILE",
        help="Text files (one document each) and/or JSONL files (.jsonl/.json, one document "
        "per line).",
    )
    source.add_argument(
        "--stdlib-corpus",
        action="store_true",
        help="Use the Python standard library's own source files as a demo corpus "
        "(offline, deterministic).",
    )
    parser.add_argument(
        "--output-dir",
        required=True,
        type=Path,
        metavar="DIR",
        help="Folder for tokenizer.model, text_document.bin/.idx and manifest.json.",
    )
    parser.add_argument(
        "--json-key",
        default="text",
        metavar="KEY",
        help="Field of each JSONL object that holds the document text (default: %(default)s).",
    )
    parser.add_argument(
        "--stdlib-max-bytes",
        type=int,
        default=STDLIB_DEFAULT_MAX_BYTES,
        metavar="N",
        help="Size budget of --stdlib-corpus in bytes (default: %(default)s).",
    )
    parser.add_argument(
        "--tokenizer-model",
        type=Path,
        metavar="PATH",
        help="Use this existing SentencePiece model instead of training one (it is copied into "
        "--output-dir).",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        metavar="N",
        default=defaults.vocab_size,
        help="Tokenizer vocabulary size; an upper bound for small corpora (default: %(default)s).",
    )
    parser.add_argument(
        "--tokenizer-algorithm",
        choices=("bpe", "unigram"),
        default=defaults.tokenizer_algorithm,
        help="SentencePiece model type (default: %(default)s).",
    )
    parser.add_argument(
        "--input-sentence-size",
        type=int,
        metavar="N",
        default=defaults.input_sentence_size,
        help="Lines sampled from the corpus for tokenizer training (default: %(default)s).",
    )
    parser.add_argument(
        "--seed",
        type=int,
        metavar="N",
        default=defaults.seed,
        help="Seed of the tokenizer's line sampling (default: %(default)s).",
    )
    parser.add_argument(
        "--workers",
        type=int,
        metavar="N",
        default=os.cpu_count() or 1,
        help="Threads for tokenizer training and encoding (default: all CPUs, %(default)s).",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="Rebuild even if the outputs are current.",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        settings = SentencePieceSettings(
            vocab_size=args.vocab_size,
            tokenizer_algorithm=args.tokenizer_algorithm,
            input_sentence_size=args.input_sentence_size,
            seed=args.seed,
        )
        corpus = (
            stdlib_corpus(max_bytes=args.stdlib_max_bytes)
            if args.stdlib_corpus
            else file_corpus(args.input, json_key=args.json_key)
        )
        prepared = prepare(
            corpus=corpus,
            output_dir=args.output_dir,
            tokenizer_model=args.tokenizer_model,
            settings=settings,
            num_threads=args.workers,
            force=args.force,
        )
    except (DataFileError, CorpusError, SettingsError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    print(
        f"{'reused' if prepared.reused else 'wrote'} {prepared.num_documents:,} documents, "
        f"{prepared.num_tokens:,} tokens, vocabulary {prepared.vocab_size}; train with:\n"
        f"  --data-path {prepared.data_prefix} --tokenizer-model {prepared.tokenizer_model}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
