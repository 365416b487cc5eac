"""Files written so that a reader never sees half of one: to a temporary name, then renamed; their
checksums, so that a reader can tell a damaged file from the one written; and where verispec
keeps what it computes once (converted checkpoints, measurements).

A cache file is checked, not trusted: bytes changed on disk (a bad sector, a stray write, a copy
cut and patched) load as plausible weights and produce garbage without an error. `seal` writes a
file's checksum beside it (NAME.crc32) and `intact` compares it with the bytes before they are
used; a cache reader that finds a file not intact logs it and builds the file again. CRC-32 (not
a cryptographic hash: this guards against accidents, and the cache is the user's own) over
memory-mapped 8 MiB chunks on all cores, since zlib releases the GIL: ~100 MB in tens of ms, and
`damaged_later` checks files on another thread while the caller reads them.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import tempfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CHECKSUM_CHUNK = 8 << 20


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], sealed: bool = False) -> Iterator[Path]:
    """Yields a temporary path beside `path` to write; on success it replaces `path` in one
    rename (a run killed while writing leaves the old file, or none, never a cut one), on an
    exception it is removed. Creates the parent directory. sealed: its checksum is written
    beside it first (`seal`; a kill between the two leaves a file that is not `intact`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(fd)
    partial = Path(name)
    try:
        yield partial
        if sealed:
            _write_checksum(path, checksum(partial))
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


def checksum(path: str | os.PathLike[str]) -> str:
    """`SIZE:CRC` of a file's bytes: the CRC-32 of the CRC-32s of its 8 MiB chunks, computed in
    parallel over a memory map."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return "0:00000000"
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
            chunks = [view[i : i + CHECKSUM_CHUNK] for i in range(0, size, CHECKSUM_CHUNK)]
            try:
                with ThreadPoolExecutor(min(len(chunks), os.cpu_count() or 1)) as pool:
                    crcs = list(pool.map(zlib.crc32, chunks))
            finally:  # the map cannot close while a slice of it is alive
                for chunk in chunks:
                    chunk.release()
    return f"{size}:{zlib.crc32(struct.pack(f'<{len(crcs)}I', *crcs)):08x}"


def _checksum_path(path: Path) -> Path:
    return path.with_name(path.name + ".crc32")


def _write_checksum(path: Path, value: str) -> None:
    with atomic_path(_checksum_path(path)) as partial:
        partial.write_text(value + "\n")


def seal(path: str | os.PathLike[str]) -> None:
    """Writes the checksum of the file at `path` beside it (`intact` checks it)."""
    _write_checksum(Path(path), checksum(path))


def intact(path: str | os.PathLike[str]) -> bool:
    """Whether the file at `path` holds the bytes `seal` (or `atomic_path(sealed=True)`) saw:
    False when it, or its checksum, is missing, unreadable or different."""
    path = Path(path)
    try:
        return _checksum_path(path).read_text().strip() == checksum(path)
    except (OSError, ValueError):
        return False


def damaged_later(paths: Sequence[Path]) -> Callable[[], list[Path]]:
    """Starts checking `paths` (`intact`) on another thread, so that a caller's own work (reading
    them, mostly holding the GIL) runs beside it; the function returned waits for the check and
    gives the paths that are not intact."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="verispec-checksum")
    check = pool.submit(lambda: [path for path in paths if not intact(path)])
    pool.shutdown(wait=False)
    return check.result
