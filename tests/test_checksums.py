"""Large files are checksummed as ranges (in parallel); verify names the damaged range."""

from __future__ import annotations

from pathlib import Path

import pytest

import dlstore.checksums as checksums
from dlstore import convert, verify
from dlstore.write.options import ConvertOptions


def test_ranged_checksums_locate_damage(
    image_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checksums, "RANGE_BYTES", 4096)
    dest = tmp_path / "c"
    convert(image_tree, dest, ConvertOptions(format="ram", size=16, workers=1))
    spec_keys = [
        k for k in checksums.checksum_tree(dest, exclude=("dlstore.json",)) if k.startswith("images.npy@")
    ]
    assert len(spec_keys) > 2
    assert verify(dest).ok
    data = bytearray((dest / "images.npy").read_bytes())
    data[5000] ^= 0xFF
    (dest / "images.npy").write_bytes(bytes(data))
    result = verify(dest)
    assert (
        not result.ok and "images.npy" in result.first_problem and "bytes 4096..8192" in result.first_problem
    )


def test_split_key_roundtrip() -> None:
    assert checksums.split_key("a/b.npz") == ("a/b.npz", 0, None)
    assert checksums.split_key("images.npy@128+64") == ("images.npy", 128, 64)
