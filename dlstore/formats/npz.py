"""``npz``: shards of many images, ``np.savez`` (stored) or ``np.savez_compressed`` (deflate)."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from dlstore.errors import CacheCorruptError
from dlstore.formats.base import CacheWriter, ChunkedReader, clamp_units, write_file_durably

SHARD_DIR = "shards"


def shard_name(k: int) -> str:
    return f"{SHARD_DIR}/shard-{k:06d}.npz"


class NpzWriter(CacheWriter):
    """One unit = one shard of about 32 MB of pixels, written to a temp name and renamed."""

    name = "npz"

    @staticmethod
    def choose_unit_size(image_bytes: int) -> int:
        return clamp_units(32 << 20, image_bytes, 16, 4096)

    def create(self) -> None:
        (self.root / SHARD_DIR).mkdir(parents=True, exist_ok=True)

    def write_unit(self, k: int, images: np.ndarray) -> None:
        buf = io.BytesIO()
        save = np.savez_compressed if self.options.get("compress") else np.savez
        save(buf, images=np.ascontiguousarray(images, dtype=np.uint8))
        write_file_durably(self.root / shard_name(k), buf.getbuffer())


class NpzReader(ChunkedReader):
    """Decodes a shard once and keeps the most recent ones (bounded bytes), so a batch that hits a
    shard costs one ``np.load`` however many of its images it takes."""

    def __init__(self, root: Path, spec: Any, in_memory: bool = False, cache_bytes: int = 512 << 20) -> None:
        super().__init__(root, spec, in_memory, unit=int(spec.format_options["unit_size"]), cache_bytes=cache_bytes)

    def load_unit(self, k: int) -> np.ndarray:
        path = self.root / shard_name(k)
        count = min(self.unit, self.spec.n_stored - k * self.unit)
        expected = (count, *self.spec.shape)
        try:
            with np.load(path, allow_pickle=False) as z:
                arr = z["images"]
        except FileNotFoundError:
            raise CacheCorruptError(f"{path}: shard missing; run `dlstore verify {self.root}` and rebuild") from None
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as e:
            raise CacheCorruptError(f"{path}: shard unreadable ({type(e).__name__}: {e}); rebuild the cache") from None
        if arr.shape != expected or arr.dtype != np.uint8:
            raise CacheCorruptError(f"{path}: holds {arr.dtype}{arr.shape}, expected uint8{expected}; rebuild")
        return arr
