"""Damage as a disk or a stray write does it: bytes changed in the middle of a file, its size
and structure intact (a cut file is the easy case, and its own tests cover it)."""

from __future__ import annotations

from pathlib import Path


def flip_middle(path: Path, count: int = 64) -> None:
    """Inverts `count` bytes at the middle of the file at `path`, in place."""
    with open(path, "r+b") as f:
        size = f.seek(0, 2)
        start = max(0, size // 2 - count // 2)
        f.seek(start)
        old = f.read(count)
        f.seek(start)
        f.write(bytes(b ^ 0xFF for b in old))
