"""sha256 of cache files, in parallel threads (hashlib releases the GIL on large updates).

A file larger than ``RANGE_BYTES`` is recorded as several byte ranges, ``name@offset+length``, each
with its own digest: one sha256 cannot be split across cores, and a range also tells ``verify``
roughly where a big file went bad.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dlstore.machine import usable_cores

RANGE_BYTES = 64 << 20
_BLOCK = 8 << 20


def file_sha256(path: Path, offset: int = 0, length: int | None = None) -> str:
    """Digest of a whole file, or of ``length`` bytes from ``offset``."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = length if length is not None else -1
        while left != 0:
            block = f.read(_BLOCK if left < 0 else min(_BLOCK, left))
            if not block:
                break
            h.update(block)
            left = left - len(block) if left > 0 else left
    return h.hexdigest()


def split_key(key: str) -> tuple[str, int, int | None]:
    """``name@offset+length`` → (name, offset, length); a plain name → (name, 0, None)."""
    name, _, span = key.rpartition("@") if "@" in key else (key, "", "")
    if not span:
        return key, 0, None
    offset, _, length = span.partition("+")
    return name, int(offset), int(length)


def keys_for(root: Path, files: list[Path]) -> list[str]:
    keys = []
    for p in files:
        rel, size = p.relative_to(root).as_posix(), p.stat().st_size
        if size <= RANGE_BYTES:
            keys.append(rel)
        else:
            keys += [f"{rel}@{o}+{min(RANGE_BYTES, size - o)}" for o in range(0, size, RANGE_BYTES)]
    return keys


def digest_key(root: Path, key: str) -> str:
    name, offset, length = split_key(key)
    return file_sha256(root / name, offset, length)


def checksum_tree(root: Path, exclude: tuple[str, ...]) -> dict[str, str]:
    files = sorted(
        p for p in root.rglob("*") if p.is_file() and p.relative_to(root).as_posix() not in exclude
    )
    return checksum_keys(root, keys_for(root, files))


def checksum_keys(root: Path, keys: list[str]) -> dict[str, str]:
    """{key: sha256} for the given keys, in parallel threads."""
    if not keys:
        return {}
    with ThreadPoolExecutor(max(1, min(16, usable_cores(), len(keys)))) as ex:
        return dict(zip(keys, ex.map(lambda k: digest_key(root, k), keys)))


def mismatches(root: Path, checksums: dict[str, str]) -> list[str]:
    """Keys whose file is missing, too short, or whose bytes changed; sorted by key."""

    def check(key: str) -> str:
        name, offset, length = split_key(key)
        path = root / name
        if not path.is_file():
            return f"{path}: missing"
        if length is not None and path.stat().st_size < offset + length:
            return f"{path}: truncated (bytes {offset}..{offset + length} missing)"
        if file_sha256(path, offset, length) != checksums[key]:
            where = f" in bytes {offset}..{offset + length}" if length is not None else ""
            return f"{path}: checksum mismatch{where} (modified or truncated)"
        return ""

    keys = sorted(checksums)
    with ThreadPoolExecutor(max(1, min(16, usable_cores()))) as ex:
        return [p for p in ex.map(check, keys) if p]


def listed_files(checksums: dict[str, str]) -> set[str]:
    return {split_key(k)[0] for k in checksums}
