"""File plumbing shared by the data path: input checks, fingerprints and atomic publishing.

Both ends of the data path meet the file system in the same three ways: a file the user named
must exist and be readable (and if not, the error must say how to make it), a cache must know
whether its inputs changed (size and modification time, like ``make``), and outputs must appear
all at once or not at all, so that an interrupted run never leaves a ``.bin`` without its
``.idx`` that a later run would mistake for a finished one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: The command that creates a tokenizer and an indexed dataset; error messages point to it.
PREPARE_COMMAND = "python -m megatron_domino.data.prepare"


class DataFileError(OSError):
    """A data-path file is missing or unreadable; the message names the file and the fix."""


def require_readable_file(path: str | os.PathLike, *, what: str, fix: str) -> Path:
    """Return ``path`` if it is a readable regular file, else raise :class:`DataFileError`.

    Args:
        path: the file to check.
        what: what the file is, as the user knows it (e.g. ``"--tokenizer-model"``).
        fix: one sentence saying how to create the file.
    """
    path = Path(path)
    if not path.exists():
        problem = "does not exist"
    elif not path.is_file():
        problem = "is not a regular file"
    else:
        try:
            with path.open("rb") as handle:
                handle.read(1)
            return path
        except OSError as err:
            problem = f"cannot be read ({err.strerror or err})"
    raise DataFileError(f"{what}: {path} {problem}. {fix}")


def file_fingerprint(path: str | os.PathLike) -> dict[str, int | str]:
    """Identity of a file's contents for caching: its absolute path, size and mtime in ns."""
    path = Path(path)
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def content_digest(path: str | os.PathLike) -> str:
    """SHA-256 hex digest of a (small) file's bytes, for inputs that get copied around, whose
    modification times say nothing."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def digest(description: object) -> str:
    """A stable SHA-256 hex digest of a JSON-serialisable description (key order ignored)."""
    text = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@contextmanager
def staged_outputs(output_dir: str | os.PathLike, *, commit_marker: str) -> Iterator[Path]:
    """Write outputs into a private staging folder, then publish them into ``output_dir``.

    Yields a fresh folder inside ``output_dir`` (so the final renames stay on one file system
    and are atomic). If the body raises, the folder is deleted and ``output_dir`` is untouched.
    On success every file written there is moved into ``output_dir`` with ``os.replace``:
    ``commit_marker`` is deleted first and moved last, so a reader that trusts only outputs
    listed by a present marker never sees a mix of old and new files, even if the process is
    killed half-way through publishing. Other files already in ``output_dir`` are left alone,
    and folders created for it are removed again if the body raises: a failed run leaves the
    file system as it found it.
    """
    output_dir = Path(output_dir)
    created = [folder for folder in (output_dir, *output_dir.parents) if not folder.exists()]
    output_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=output_dir))
    try:
        yield staging
        names = sorted(entry.name for entry in staging.iterdir())
        if commit_marker not in names:
            raise RuntimeError(
                f"staged outputs in {staging} lack the commit marker {commit_marker}"
            )
        (output_dir / commit_marker).unlink(missing_ok=True)
        for name in names:
            if name != commit_marker:
                os.replace(staging / name, output_dir / name)
        os.replace(staging / commit_marker, output_dir / commit_marker)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for folder in created:  # innermost first; only if still empty
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
