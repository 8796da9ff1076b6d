"""Checks of the files a training run reads, made before it starts.

Megatron-Core opens a ``--data-path`` prefix's ``.idx`` on the first rank that builds the
datasets, after the process groups, the model and the optimizer exist, and reads the ``.bin``
lazily: a missing, empty, foreign or truncated file surfaces as an ``AssertionError``, a
``ValueError: cannot mmap an empty file`` or, for a truncated ``.bin``, a failure in a
DataLoader worker after the index caches were written. A tokenizer file fails inside
SentencePiece's C++ with ``could not parse ModelProto``. These checks read only the fixed-size
header of an ``.idx`` and one entry at each end of its arrays, so they cost the same for a
50 GB dataset as for a tiny one, and raise :class:`~megatron_domino.data.files.DataFileError`
naming the file, what is wrong with it, and how to make a good one.

The ``.idx`` layout is Megatron-Core's (``megatron/core/datasets/indexed_dataset.py``,
``_IndexWriter``): the 9-byte magic ``MMIDIDX\\x00\\x00``, version ``<Q`` (1), dtype code ``<B``,
sequence count ``<Q``, document count ``<Q``, then ``int32`` sequence lengths, ``int64`` byte
offsets of the sequences in the ``.bin``, and ``int64`` document indices.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy
import sentencepiece
from megatron.core.datasets.indexed_dataset import DType, get_bin_path, get_idx_path

from megatron_domino.data.files import PREPARE_COMMAND, DataFileError, require_readable_file

__all__ = ["check_indexed_dataset", "check_sentencepiece_model"]

_INDEX_MAGIC = b"MMIDIDX\x00\x00"
#: magic (9) + version (8) + dtype code (1) + sequence count (8) + document count (8).
_INDEX_HEADER_BYTES = 34

_REMAKE = (
    f"Re-create it with `{PREPARE_COMMAND} ... --output-dir DIR` (or Megatron's preprocess_data.py)"
)


def check_indexed_dataset(prefix: str, *, what: str = "--data-path") -> None:
    """Raise :class:`DataFileError` unless ``prefix.idx``/``prefix.bin`` are a readable,
    complete Megatron indexed dataset: a valid header, an ``.idx`` of exactly the size its
    header implies, and a ``.bin`` that holds every sequence the index points to."""
    idx_path, bin_path = Path(get_idx_path(prefix)), Path(get_bin_path(prefix))
    fix = f"{_REMAKE} and pass its prefix (DIR/text_document)."
    for path in (idx_path, bin_path):
        require_readable_file(path, what=f"{what} {prefix}", fix=fix)

    def bad(path: Path, problem: str) -> DataFileError:
        return DataFileError(f"{what} {prefix}: {path} {problem}. {fix}")

    idx_size, bin_size = idx_path.stat().st_size, bin_path.stat().st_size
    with idx_path.open("rb") as index:
        header = index.read(_INDEX_HEADER_BYTES)
    if len(header) < _INDEX_HEADER_BYTES or header[:9] != _INDEX_MAGIC:
        what_it_is = "is empty" if idx_size == 0 else "is not a Megatron index (no MMIDIDX header)"
        raise bad(idx_path, what_it_is)
    version, code, sequences, documents = struct.unpack("<QBQQ", header[9:])
    if version != 1:
        raise bad(idx_path, f"has index version {version}; Megatron-Core reads version 1")
    try:
        itemsize = DType.size(code)
    except ValueError:
        raise bad(
            idx_path, f"names token dtype code {code}, which Megatron-Core does not know"
        ) from None
    expected = _INDEX_HEADER_BYTES + sequences * (4 + 8) + documents * 8
    if idx_size != expected:
        raise bad(
            idx_path,
            f"is {idx_size} bytes, but its header ({sequences} sequences, {documents} document "
            f"indices) needs {expected}: it is truncated or was overwritten",
        )
    if sequences == 0:
        raise bad(idx_path, "indexes no sequences: there is nothing to train on")
    lengths = numpy.memmap(idx_path, numpy.int32, "r", _INDEX_HEADER_BYTES, (sequences,))
    offsets_at = _INDEX_HEADER_BYTES + 4 * sequences
    offsets = numpy.memmap(idx_path, numpy.int64, "r", offsets_at, (sequences,))
    needed = int(offsets[-1]) + int(lengths[-1]) * itemsize
    if bin_size != needed:
        problem = "is truncated" if bin_size < needed else "is longer than its index says"
        raise bad(
            bin_path,
            f"{problem}: {bin_size} bytes, but {idx_path.name} points to {needed} "
            "(the pair was not written together, or a copy was cut short)",
        )


def check_sentencepiece_model(path: str | os.PathLike, *, what: str, fix: str) -> Path:
    """Return ``path`` if SentencePiece can load it, else raise :class:`DataFileError`."""
    path = require_readable_file(path, what=what, fix=fix)
    try:
        sentencepiece.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError) as err:
        problem = (
            "is empty" if path.stat().st_size == 0 else f"is not a SentencePiece model ({err})"
        )
        raise DataFileError(f"{what}: {path} {problem}. {fix}") from err
    return path
