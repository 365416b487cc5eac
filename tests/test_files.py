"""Cache files' checksums (verispec.files): what is sealed is intact until a byte changes."""

from __future__ import annotations

import os

import pytest

from verispec.files import CHECKSUM_CHUNK, atomic_path, checksum, damaged_later, intact, seal

from .damage import flip_middle


@pytest.mark.parametrize("size", [0, 1, 1000, CHECKSUM_CHUNK, 2 * CHECKSUM_CHUNK + 5])
def test_a_sealed_file_is_intact_until_a_byte_in_its_middle_changes(tmp_path, size) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(size))
    assert not intact(path)  # no checksum written yet
    seal(path)
    assert intact(path)
    if size:
        flip_middle(path, 1)
        assert not intact(path)


def test_atomic_path_seals_what_it_renames_and_nothing_on_failure(tmp_path) -> None:
    path = tmp_path / "f.json"
    with atomic_path(path, sealed=True) as partial:
        partial.write_text("{}")
    assert intact(path) and sorted(p.name for p in tmp_path.iterdir()) == ["f.json", "f.json.crc32"]
    with pytest.raises(KeyboardInterrupt), atomic_path(tmp_path / "g.json", sealed=True) as partial:
        partial.write_text("{")
        raise KeyboardInterrupt
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json", "f.json.crc32"]


def test_the_checksum_depends_on_every_chunk_and_on_the_length(tmp_path) -> None:
    path = tmp_path / "data.bin"
    data = bytearray(os.urandom(3 * CHECKSUM_CHUNK))
    path.write_bytes(data)
    before = checksum(path)
    data[2 * CHECKSUM_CHUNK + 7] ^= 1
    path.write_bytes(data)
    assert checksum(path) != before
    path.write_bytes(data + b"\0")
    assert checksum(path).split(":")[0] == str(3 * CHECKSUM_CHUNK + 1)


def test_damaged_later_names_the_files_that_are_not_intact(tmp_path) -> None:
    paths = [tmp_path / f"{name}.bin" for name in "abcd"]
    for path in paths:
        path.write_bytes(os.urandom(CHECKSUM_CHUNK + 7))
        seal(path)
    flip_middle(paths[1], 1)
    paths[3].unlink()
    assert damaged_later(paths)() == [paths[1], paths[3]]
    assert damaged_later(paths[::2])() == []
