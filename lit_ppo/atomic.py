"""Atomic writes: a reader (a resumed run, a notebook, another rank) sees the old file or the new one whole, never
a half-written one. Every file lit-ppo writes to be read back goes through here."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def temporary_sibling(path: Path) -> Path:
    """`<name>.tmp` beside `path`: same file system, so the final rename is atomic; never read back."""
    return path.with_name(path.name + ".tmp")


def replace_durably(tmp: Path, path: Path) -> None:
    """Move a finished file (or a new directory) into place; a file is flushed to disk first, so a power loss
    after the rename cannot leave an empty file under the final name."""
    if tmp.is_file():
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself
    finally:
        os.close(directory)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path to write a file or a directory to; it replaces `path` when the block ends without an
    error, and is removed otherwise. For a directory, a `path` that appeared meanwhile (another process filling
    the same cache) wins and ours is dropped: both hold the same content."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(path)
    _remove(tmp)  # left by a crash
    try:
        yield tmp
        if tmp.is_dir() and path.is_dir():
            _remove(tmp)
        else:
            replace_durably(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def directory_problem(directory: str | Path) -> str | None:
    """Why files cannot be written into `directory` (made where it is missing), in words, or None. Tried, not
    inferred from the mode bits: a read-only mount refuses root too. Leaves nothing behind: a missing directory is
    tried at its nearest existing parent, where it would be made."""
    directory = Path(directory).expanduser().absolute()
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a directory"
    try:
        handle, probe = tempfile.mkstemp(prefix=".lit_ppo_write_probe_", dir=existing)
    except OSError as e:
        made = "" if existing == directory else f" (where {directory.relative_to(existing)} would be made)"
        link = f" (a link to {existing.resolve()})" if existing.is_symlink() else ""
        return f"{existing}{link}{made} is not writable ({e.strerror or type(e).__name__})"
    os.close(handle)
    os.unlink(probe)
    return None


FULL = {errno.ENOSPC: "no space left on device (ENOSPC)", errno.EDQUOT: "disk quota exceeded (EDQUOT)"}
"""The errors of a full file system (or of the user's quota on it), in words."""


def space_problem(error: BaseException, directory: str | Path) -> str | None:
    """`<directory>: no space left on device (ENOSPC)` where `error`, or an error it was raised while handling, is a
    full file system's (torch's zip writer turns the OSError of a failed write into a RuntimeError of its own); None
    otherwise."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in FULL:
            return f"{directory}: {FULL[seen.errno]}"
        seen = seen.__cause__ or seen.__context__
    return None


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
