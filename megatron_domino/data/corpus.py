"""Where documents come from: the user's text/JSONL files, or the Python standard library.

A :class:`Corpus` is re-iterable (tokenizer training and tokenisation each read it once) and
carries a fingerprint of everything that decides its documents, so that
:mod:`megatron_domino.data.prepare` can tell when cached outputs are still valid without
reading the text.
"""

from __future__ import annotations

import json
import os
import random
import sys
import sysconfig
import tokenize
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_domino.data.files import digest, file_fingerprint, require_readable_file

#: Input files with these suffixes hold one JSON object per line (Megatron's convention).
JSONL_SUFFIXES = (".jsonl", ".json")

#: Standard-library files that hold real prose or code written by the Python developers.
STDLIB_SUFFIXES = (".py", ".txt", ".rst")

#: Standard-library folders left out of the demo corpus. The test suites are half the library,
#: full of deliberately odd inputs (bad encodings, huge literals), and often not installed at all
#: (Debian ships them separately), so leaving them out keeps the corpus alike across machines.
STDLIB_EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)


#: Default size budget of :func:`stdlib_corpus`: prepares in seconds on two cores.
STDLIB_DEFAULT_MAX_BYTES = 8_000_000

#: Fixed, so that the demo corpus is the same on every run.
STDLIB_SHUFFLE_SEED = 0


class CorpusError(ValueError):
    """An input document cannot be read; the message names the file, the line and the fix."""


@dataclass(frozen=True, kw_only=True)
class Corpus:
    """A re-iterable source of documents (``str``), with what decides them.

    Attributes:
        description: one human-readable line for logs and the cache manifest.
        fingerprint: digest of every input that decides the documents (paths, sizes, mtimes,
            selection settings); equal fingerprints mean equal documents.
        read_documents: returns a fresh iterator over the documents, in a fixed order.
    """

    description: str
    fingerprint: str
    read_documents: Callable[[], Iterator[str]]

    def __iter__(self) -> Iterator[str]:
        return self.read_documents()


def file_corpus(paths: Sequence[str | os.PathLike], *, json_key: str = "text") -> Corpus:
    """Documents from text and JSONL files, in the order given.

    A text file is one document. A ``.jsonl``/``.json`` file holds one JSON object per line and
    each object's ``json_key`` field is one document (blank lines are skipped).

    Raises:
        DataFileError: a path is missing, not a file, or unreadable (checked here, up front).
        CorpusError: while reading, a file is not UTF-8, a JSONL line is not a JSON object, or
            lacks ``json_key``, or its value is not a string.
    """
    if not paths:
        raise CorpusError("no input files given: pass text or JSONL files with --input.")
    files = [
        require_readable_file(
            path, what="--input", fix="Pass existing text or JSONL (.jsonl/.json) files."
        )
        for path in paths
    ]
    has_jsonl = any(path.suffix in JSONL_SUFFIXES for path in files)
    description = {
        "files": [file_fingerprint(path) for path in files],
        "json_key": json_key if has_jsonl else None,
    }

    def read_documents() -> Iterator[str]:
        for path in files:
            if path.suffix in JSONL_SUFFIXES:
                yield from _read_jsonl(path, json_key=json_key)
            else:
                yield _read_utf8(path)

    return Corpus(
        description=f"{len(files)} input file(s): " + ", ".join(str(path) for path in files),
        fingerprint=digest(description),
        read_documents=read_documents,
    )


def stdlib_corpus(*, max_bytes: int = STDLIB_DEFAULT_MAX_BYTES) -> Corpus:
    """A demo corpus that exists offline wherever Python does: the standard library's source.

    Takes the ``.py``, ``.txt`` and ``.rst`` files under ``sysconfig.get_paths()["stdlib"]``
    (without the test suites, see :data:`STDLIB_EXCLUDED_DIRS`), shuffles their sorted list
    with a fixed seed so that the budget samples the whole library rather than its
    alphabetically first packages, and keeps each file that still fits into ``max_bytes``.
    Each file is one document. The selection is deterministic for a given installation.

    The default budget (8 MB, about 2.4 M tokens with an 8000-piece BPE vocabulary) prepares in
    about 10 s on two cores; all of Python 3.11's library outside the tests is 12.3 MB.
    """
    if max_bytes <= 0:
        raise CorpusError(f"--stdlib-max-bytes must be positive, got {max_bytes}.")
    root = Path(sysconfig.get_paths()["stdlib"])
    candidates = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in STDLIB_EXCLUDED_DIRS]
        candidates.extend(Path(folder, name) for name in names if name.endswith(STDLIB_SUFFIXES))
    candidates.sort()
    random.Random(STDLIB_SHUFFLE_SEED).shuffle(candidates)
    selected, stats, total = [], [], 0
    for path in candidates:
        stat = path.stat()
        if 0 < stat.st_size <= max_bytes - total:
            selected.append(path)
            stats.append(stat)
            total += stat.st_size
    if not selected:
        raise CorpusError(
            f"no standard-library source files found under {root} within {max_bytes} bytes; "
            "this Python may ship its library zipped. Use --input with your own files instead."
        )
    description = {
        "python": sys.version,
        "max_bytes": max_bytes,
        "files": [
            [str(path.relative_to(root)), stat.st_size, stat.st_mtime_ns]
            for path, stat in zip(selected, stats, strict=True)
        ],
    }

    def read_documents() -> Iterator[str]:
        for path in selected:
            yield _read_python_source(path) if path.suffix == ".py" else _read_utf8(path)

    return Corpus(
        description=f"Python {sys.version.split()[0]} standard library: {len(selected)} files, "
        f"{total / 1e6:.1f} MB from {root}",
        fingerprint=digest(description),
        read_documents=read_documents,
    )


def _read_utf8(path: Path) -> str:
    """The file's text exactly: ``newline=""`` keeps ``\r\n`` instead of translating it."""
    try:
        with path.open(encoding="utf-8", newline="") as handle:
            return handle.read()
    except UnicodeDecodeError as err:
        raise CorpusError(
            f"{path}: not UTF-8 text (byte {err.start}: {err.reason}); convert it to UTF-8."
        ) from err


def _read_python_source(path: Path) -> str:
    """Python source honours its PEP 263 coding cookie, which is not always UTF-8."""
    try:
        with tokenize.open(path) as handle:
            return handle.read()
    except (SyntaxError, UnicodeDecodeError) as err:
        raise CorpusError(f"{path}: cannot decode Python source ({err}).") from err


def _read_jsonl(path: Path, *, json_key: str) -> Iterator[str]:
    with path.open(encoding="utf-8") as handle:
        try:
            for line_number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise CorpusError(
                        f"{path}:{line_number}: not valid JSON ({err.msg}); a JSONL file holds "
                        "one JSON object per line."
                    ) from err
                if not isinstance(record, dict) or json_key not in record:
                    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise CorpusError(
                        f"{path}:{line_number}: no {json_key!r} field (found {keys}); choose the "
                        "field that holds the text with --json-key."
                    )
                text = record[json_key]
                if not isinstance(text, str):
                    raise CorpusError(
                        f"{path}:{line_number}: field {json_key!r} is a "
                        f"{type(text).__name__}, not a string."
                    )
                yield text
        except UnicodeDecodeError as err:
            raise CorpusError(f"{path}: not UTF-8 text ({err.reason}).") from err
