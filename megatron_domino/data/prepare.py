"""Turn a corpus into what Megatron-Core trains on: a SentencePiece model and a .bin/.idx pair.

One output folder holds ``tokenizer.model``, ``text_document.bin``/``.idx`` (written with
Megatron-Core's ``IndexedDatasetBuilder``: one sequence per input document, each ending with the
end-of-document token) and ``manifest.json``. The manifest records a digest of the inputs and
settings; a re-run with the same digest reuses the outputs, anything else rebuilds them. Outputs
are staged and published only when complete (:func:`~megatron_domino.data.files.staged_outputs`).

Command line::

    python -m megatron_domino.data.prepare --stdlib-corpus --output-dir data_cache/stdlib
    python -m megatron_domino.data.prepare --input docs.jsonl --json-key text --output-dir DIR

then train with ``--data-path DIR/text_document --tokenizer-model DIR/tokenizer.model``
(``megatron-domino-prepare-data`` is the same command). The tokenizer is trained by
:mod:`megatron_domino.data.tokenizer`; this module is the preparation and its command line,
whose flag definitions are a third of its length.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
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
from megatron_domino.data.tokenizer import (
    Progress,
    SentencePieceSettings,
    SettingsError,
    train_sentencepiece,
)

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.model"
DATA_PREFIX_NAME = "text_document"
MANIFEST_FILE = "manifest.json"
#: Bump when the output layout or the tokenisation changes, so old caches are rebuilt.
MANIFEST_FORMAT = 1

#: Documents handed to SentencePiece per multi-threaded encode call.
ENCODE_BATCH_DOCUMENTS = 256


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
    progress = Progress("tokenising")
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
        "--tokenizer-algorithm",
        choices=("bpe", "unigram"),
        default=defaults.tokenizer_algorithm,
        help="SentencePiece model type (default: %(default)s).",
    )
    whole_numbers = {
        "--vocab-size": (
            defaults.vocab_size,
            "Tokenizer vocabulary size; an upper bound for small corpora (default: %(default)s).",
        ),
        "--input-sentence-size": (
            defaults.input_sentence_size,
            "Lines sampled from the corpus for tokenizer training (default: %(default)s).",
        ),
        "--seed": (defaults.seed, "Seed of the tokenizer's line sampling (default: %(default)s)."),
        "--workers": (
            os.cpu_count() or 1,
            "Threads for tokenizer training and encoding (default: all CPUs, %(default)s).",
        ),
    }
    for flag, (default, help_text) in whole_numbers.items():
        parser.add_argument(flag, type=int, metavar="N", default=default, help=help_text)
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
