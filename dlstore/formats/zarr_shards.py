"""zarr v3's sharding codec (``sharding_indexed``) for the ``zarr`` format: many ~1 MB chunks (what a
read decodes) inside one shard file of tens of MB (what an object store fetches per request and a
converter writes). The array stays plain zarr v3; dlstore reads it directly: the shard index
(``chunks_per_shard`` × (offset, nbytes) uint64 LE plus a crc32c, at the end or start of the file) once
per shard, checked; a chunk is one ``pread`` at its offset, decoded with the inner codec."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dlstore.errors import CacheCorruptError, SpecError

EMPTY = (1 << 64) - 1  # zarr's (offset, nbytes) for a chunk that was never written
_INDEX_ENTRY = 16


def load_array_meta(path: Path) -> Any:
    """An array's ``zarr.json``, parsed; missing or unreadable is a CacheCorruptError naming it.
    What the readers then validate (zarr_cache: pixels and payloads; fields: field arrays) is theirs."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CacheCorruptError(f"{path}: missing zarr array metadata; rebuild the cache") from None
    except (OSError, ValueError) as e:
        raise CacheCorruptError(f"{path}: unreadable zarr metadata ({e}); rebuild the cache") from None


@dataclass(frozen=True)
class Sharding:
    """What ``images/zarr.json`` says about its shards, validated."""

    chunk: int  # images per inner chunk: what one read decodes
    per_shard: int  # inner chunks per shard file
    codecs: list[Any]  # the inner chunk's codec chain (``bytes`` then at most one compressor)
    at_end: bool  # index location
    crc: bool  # index followed by its crc32c

    @property
    def index_bytes(self) -> int:
        return self.per_shard * _INDEX_ENTRY + (4 if self.crc else 0)


def parse_sharding(path: Path, codec: dict[str, Any], shard_len: int, shape: tuple[int, ...]) -> Sharding:
    """``codec`` is the array's one ``sharding_indexed`` entry; shards hold ``shard_len`` images."""
    conf = codec.get("configuration") or {}
    inner = conf.get("chunk_shape")
    if not (
        isinstance(inner, list)
        and len(inner) == 4
        and inner[1:] == list(shape)
        and isinstance(inner[0], int)
        and 1 <= inner[0] <= shard_len
        and shard_len % inner[0] == 0
    ):
        raise SpecError(
            f"{path}: inner chunk shape {inner} not (k, {', '.join(map(str, shape))}) with k dividing "
            f"the shard length {shard_len}"
        )
    index = conf.get("index_codecs", [{"name": "bytes", "configuration": {"endian": "little"}}])
    names = [c.get("name") if isinstance(c, dict) else c for c in index] if isinstance(index, list) else []
    endian = (index[0].get("configuration") or {}).get("endian", "little") if names[:1] == ["bytes"] else None
    if names not in (["bytes"], ["bytes", "crc32c"]) or endian != "little":
        raise SpecError(f"{path}: shard index codecs {index} not supported (bytes little-endian [+ crc32c])")
    location = conf.get("index_location", "end")
    if location not in ("start", "end"):
        raise SpecError(f"{path}: shard index location {location!r} is neither 'start' nor 'end'")
    return Sharding(inner[0], shard_len // inner[0], conf.get("codecs"), location == "end", len(names) == 2)


class ShardIndexes:
    """The (offset, nbytes) of every inner chunk, per shard file, read on first use and kept (16 bytes
    per chunk). A damaged index is an error naming the file, never a read at a wrong offset."""

    def __init__(self, sharding: Sharding) -> None:
        self.sharding = sharding
        self._indexes: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()

    def chunk_range(self, path: Path, j: int) -> tuple[int, int]:
        """Byte offset and length of inner chunk ``j`` in the shard file at ``path``."""
        key = os.fspath(path)
        index = self._indexes.get(key)
        if index is None:
            index = read_index(path, self.sharding)
            with self._lock:
                self._indexes[key] = index
        offset, nbytes = (int(v) for v in index[j])
        if offset == EMPTY and nbytes == EMPTY:
            raise CacheCorruptError(
                f"{path}: inner chunk {j} was never written (zarr would read zeros); rebuild"
            )
        return offset, nbytes

    def clear(self) -> None:
        with self._lock:
            self._indexes.clear()


def read_index(path: Path, sharding: Sharding) -> np.ndarray:
    """The shard's index as (chunks_per_shard, 2) uint64, its crc32c checked, every range in the file."""
    size_needed = sharding.index_bytes
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size < size_needed:
            raise CacheCorruptError(f"{path}: {size} bytes, shorter than its shard index; rebuild the cache")
        raw = os.pread(fd, size_needed, size - size_needed if sharding.at_end else 0)
    finally:
        os.close(fd)
    body = raw[: sharding.per_shard * _INDEX_ENTRY]
    if sharding.crc:
        import google_crc32c  # zarr's own dependency for its crc32c codec

        if google_crc32c.value(body) != int.from_bytes(raw[-4:], "little"):
            raise CacheCorruptError(f"{path}: shard index checksum mismatch; rebuild the cache")
    index = np.frombuffer(body, "<u8").reshape(sharding.per_shard, 2)
    written = ~((index[:, 0] == EMPTY) & (index[:, 1] == EMPTY))
    if np.any(index[written, 0] + index[written, 1] > size):
        raise CacheCorruptError(f"{path}: shard index points past the end of the file; rebuild the cache")
    return index


def declared_size(raw: memoryview) -> int:
    """Decompressed size a zstd frame or blosc chunk declares in its header; -1 if it does not."""
    head = bytes(raw[:18])
    if head[:4] == b"\x28\xb5\x2f\xfd" and len(head) >= 6:  # zstd frame
        desc = head[4]
        fcs_flag, single = desc >> 6, (desc >> 5) & 1
        pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[desc & 3]
        width = (1 if single else 0, 2, 4, 8)[fcs_flag]
        if width == 0:
            return -1
        value = int.from_bytes(head[pos : pos + width], "little")
        return value + 256 if width == 2 else value
    if len(head) >= 16:  # blosc: version, versionlz, flags, typesize, then nbytes (uint32 LE)
        return int.from_bytes(head[4:8], "little")
    return -1


def decompress_within(decode: Callable[..., Any], raw: Any, limit: int, out: Any = None) -> Any:
    """A zstd frame or blosc chunk decoded only when the size its header declares is within ``limit``
    (what the index says it holds: a 44 KB frame may declare 1.5 GB), into exactly that many bytes:
    ``out`` when given, which it must then fill."""
    size = declared_size(memoryview(raw))
    if not 0 <= size <= limit or (out is not None and size != out.nbytes):
        raise ValueError(f"declares {size if size >= 0 else 'no'} decoded bytes, its index allows {limit}")
    return decode(raw, out=np.empty(size, np.uint8) if out is None else out)
