"""sha256 of cache files, in parallel threads (hashlib releases the GIL on large updates).

A file larger than ``RANGE_BYTES`` is recorded as several byte ranges, ``name@offset+length``, each
with its own digest: one sha256 cannot be split across cores, and a range also tells ``verify``
roughly where a big file went bad.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dlstore.errors import CacheCorruptError
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


# A byte range as the writers spell it: decimal digits only (no sign, no spaces, no exponent), so
# ``int()`` never sees "-5", " 1", "1e9" or "nan"; 15 digits bound a range to under a petabyte.
_SPAN = re.compile(r"^(0|[1-9][0-9]{0,14})\+([1-9][0-9]{0,14})$")
MAX_FILE_BYTES = 1 << 50


class ChecksumKeyError(ValueError):
    """A checksum key of a manifest is not ``name`` or ``name@offset+length`` with sane numbers."""


def split_key(key: str) -> tuple[str, int, int | None]:
    """``name@offset+length`` → (name, offset, length); a plain name → (name, 0, None). A key whose
    range is not two non-negative decimal numbers (length > 0) raises ChecksumKeyError."""
    if not isinstance(key, str):
        raise ChecksumKeyError(f"checksum key {key!r} is not a string")
    if "@" not in key:
        return key, 0, None
    name, _, span = key.rpartition("@")
    match = _SPAN.match(span)
    if not name or match is None:
        raise ChecksumKeyError(
            f"checksum key {key!r}: byte range {span!r} is not OFFSET+LENGTH (decimal, length > 0)"
        )
    return name, int(match[1]), int(match[2])


def extents(checksums: dict[str, str]) -> dict[str, int]:
    """File name → how many bytes its keys cover, from 0. The keys of each file must tile it: one
    plain key (the whole file), or ranges back to back from 0, none overlapping, no gap, so that
    the checksums cover every byte below the extent (the file's size must then equal it)."""
    ranges: dict[str, list[tuple[int, int | None]]] = {}
    for key, digest in checksums.items():
        name, offset, length = split_key(key)
        if not isinstance(digest, str) or re.fullmatch(r"[0-9a-f]{64}", digest) is None:
            raise ChecksumKeyError(f"checksum of {key!r} is not a sha256 hex digest: {digest!r}")
        ranges.setdefault(name, []).append((offset, length))
    out = {}
    for name, spans in ranges.items():
        if any(length is None for _, length in spans):
            if len(spans) > 1:
                raise ChecksumKeyError(f"{name}: listed both whole and by byte range")
            out[name] = -1  # whole file: its size is whatever the digest covers
            continue
        end = 0
        for offset, length in sorted(spans):  # type: ignore[type-var]
            if offset != end:
                raise ChecksumKeyError(
                    f"{name}: checksummed byte ranges {'overlap' if offset < end else 'leave a gap'} at "
                    f"byte {min(offset, end)}"
                )
            end = offset + int(length)  # type: ignore[arg-type]
        if end > MAX_FILE_BYTES:
            raise ChecksumKeyError(f"{name}: checksummed ranges reach byte {end}, beyond any real file")
        out[name] = end
    return out


def regular_files(root: Path) -> dict[str, int]:
    """Every file under ``root`` (relative POSIX name → size), without following a symlink or
    opening anything. A cache holds only folders and regular files: a symlink (it may lead outside
    the cache), a FIFO (opening it blocks), a device or a socket is refused, naming it."""
    found: dict[str, int] = {}
    todo = [Path(root)]
    while todo:
        folder = todo.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                st = entry.stat(follow_symlinks=False)
                rel = Path(entry.path).relative_to(root).as_posix()
                if stat.S_ISDIR(st.st_mode):
                    todo.append(Path(entry.path))
                elif stat.S_ISREG(st.st_mode):
                    found[rel] = st.st_size
                else:
                    raise CacheCorruptError(
                        f"{entry.path}: a {file_kind(st.st_mode)} inside the cache, where dlstore writes "
                        "only regular files and folders; refusing to open it (never followed or read). "
                        "The cache may be tampered with: rebuild it with `dlstore convert`"
                    )
    return found


def file_kind(mode: int) -> str:
    kinds = {
        stat.S_ISLNK: "symlink",
        stat.S_ISFIFO: "FIFO (named pipe)",
        stat.S_ISCHR: "character device",
        stat.S_ISBLK: "block device",
        stat.S_ISSOCK: "socket",
    }
    return next((name for test, name in kinds.items() if test(mode)), "special file")


def size_problems(
    root: Path, checksums: dict[str, str], present: dict[str, int], lazy: bool = False
) -> list[str]:
    """Files whose size is not what the manifest's checksums cover (extra bytes appended, or
    truncated), or that are missing (unless ``lazy``: a remote mirror fetches them later)."""
    problems = []
    for name, extent in sorted(extents(checksums).items()):
        size = present.get(name)
        if size is None:
            if not lazy:
                problems.append(f"{root / name}: missing")
        elif extent >= 0 and size > extent:
            problems.append(
                f"{root / name}: {size} bytes, but the manifest's checksums cover only {extent} "
                f"(bytes {extent}..{size} were appended or the manifest was edited)"
            )
        elif extent >= 0 and size < extent:
            problems.append(f"{root / name}: truncated ({size} bytes, the manifest lists {extent})")
    return problems


def keys_for(root: Path, files: list[Path]) -> list[str]:
    keys = []
    for p in files:
        rel, size = p.relative_to(root).as_posix(), p.stat().st_size
        if size == 0:
            keys.append(rel)
        else:  # even a small file by its range: its size is declared, so bytes appended show at open
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
        try:
            st = os.lstat(path)
        except OSError:
            return f"{path}: missing"
        if not stat.S_ISREG(st.st_mode):
            return f"{path}: a {file_kind(st.st_mode)}, not a regular file (never followed or read)"
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
