"""Files written so that a reader never sees half of one: to a temporary name, then renamed; and
where verispec keeps what it computes once (converted checkpoints, measurements)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yields a temporary path beside `path` to write; on success it replaces `path` in one
    rename (a run killed while writing leaves the old file, or none, never a cut one), on an
    exception it is removed. Creates the parent directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(fd)
    partial = Path(name)
    try:
        yield partial
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def check_writable(path: str | os.PathLike[str], what: str) -> None:
    """Raises ValueError naming `what` when a file cannot be written at `path` (its directory
    missing and not creatable, read-only, or `path` a directory), before hours of work that end
    in writing it."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what}={str(path)!r} is a directory: expected a file path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".probe"):
            pass
    except OSError as error:
        raise ValueError(f"{what}={str(path)!r} cannot be written: {error.strerror or error}") from None


def cache_dir() -> Path:
    """$VERISPEC_CACHE_DIR, default ~/.cache/verispec."""
    return Path(os.environ.get("VERISPEC_CACHE_DIR") or Path.home() / ".cache" / "verispec")
