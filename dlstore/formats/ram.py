"""``ram``: every image in one raw ``images.npy`` (N,H,W,C) uint8, memory-mapped or loaded whole."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import ClassVar

import numpy as np

from dlstore import checksums
from dlstore.errors import CacheCorruptError
from dlstore.formats.base import CacheReader, CacheWriter, clamp_units
from dlstore.formats.describe import Traits

IMAGES_FILE = "images.npy"


class RamWriter(CacheWriter):
    """Pre-sizes the .npy once; workers ``pwrite`` their slab at its byte offset (no IPC of pixels)."""

    name = "ram"
    field_layout = "arrays"

    @staticmethod
    def choose_unit_size(image_bytes: int) -> int:
        return clamp_units(8 << 20, image_bytes, 16, 4096)

    @property
    def path(self) -> Path:
        return self.root / IMAGES_FILE

    def create(self) -> None:
        mm = np.lib.format.open_memmap(self.path, mode="w+", dtype=np.uint8, shape=(self.n, *self.shape))
        self.options["header_bytes"] = int(mm.offset)
        del mm

    def write_unit(self, k: int, images: np.ndarray) -> None:
        offset = self.options["header_bytes"] + k * self.unit_size * self.image_bytes
        fd = os.open(self.path, os.O_WRONLY)
        try:
            data = memoryview(np.ascontiguousarray(images, dtype=np.uint8)).cast("B")
            while data:
                written = os.pwrite(fd, data, offset)
                data, offset = data[written:], offset + written
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def unit_checksum_keys(self, k: int) -> list[str]:
        return [f"{IMAGES_FILE}@{offset}+{length}" for offset, length in self._unit_pieces(k)]

    def unit_checksums(self, k: int, images: np.ndarray) -> dict[str, str]:
        # Hashing the slab while it is still in this worker's memory spares the main process a
        # second pass over the whole file after the last unit.
        parts = [memoryview(np.ascontiguousarray(images, dtype=np.uint8)).cast("B")]
        if k == 0:  # unit 0's range starts at the file's start: the .npy header ``create`` wrote
            fd = os.open(self.path, os.O_RDONLY)
            try:
                parts.insert(0, memoryview(os.pread(fd, self.options["header_bytes"], 0)))
            finally:
                os.close(fd)
        sums = {}
        for key, (_, length) in zip(self.unit_checksum_keys(k), self._unit_pieces(k)):
            h = hashlib.sha256()
            while length:
                take = min(length, len(parts[0]))
                h.update(parts[0][:take])
                parts[0], length = parts[0][take:], length - take
                if not parts[0]:
                    parts.pop(0)
            sums[key] = h.hexdigest()
        return sums

    def _unit_pieces(self, k: int) -> list[tuple[int, int]]:
        """(offset, length) of unit k's bytes in images.npy, in ranges of at most ``RANGE_BYTES`` (so
        ``verify`` still says roughly where a file went bad); unit 0 also holds the header, so the
        units tile the file."""
        header, r = self.options["header_bytes"], self.unit_range(k)
        start, stop = (
            (0 if k == 0 else header + r.start * self.image_bytes),
            header + r.stop * self.image_bytes,
        )
        step = checksums.RANGE_BYTES
        return [(o, min(step, stop - o)) for o in range(start, stop, step)]

    def recorded_options(self) -> dict[str, object]:
        return {"unit_size": self.unit_size}


class RamReader(CacheReader):
    """Memory-maps ``images.npy`` (pages shared by every process), or with ``in_memory`` loads it into
    one contiguous array, which forked DataLoader workers share copy-on-write."""

    # The memory map is taken at open: pages are shared by forked children, and a cache swapped
    # underneath keeps reading its own generation.
    traits: ClassVar[Traits] = Traits(
        loads_into_ram=True, unit_grouped=False, fork_safe=True, opens_files_per_read=False
    )
    field_layout = "arrays"

    def __init__(self, root: Path, spec, in_memory: bool = False) -> None:  # type: ignore[no-untyped-def]
        super().__init__(root, spec, in_memory)
        path = self.root / IMAGES_FILE
        expected = (spec.n_stored, *spec.shape)
        try:
            arr = np.load(path, mmap_mode=None if in_memory else "r", allow_pickle=False)
        except FileNotFoundError:
            raise CacheCorruptError(f"{path}: missing; run `dlstore verify {root}` and rebuild") from None
        except ValueError as e:
            raise CacheCorruptError(f"{path}: unreadable or truncated ({e}); rebuild the cache") from None
        if arr.shape != expected or arr.dtype != np.uint8:
            raise CacheCorruptError(
                f"{path}: holds {arr.dtype}{arr.shape}, manifest says uint8{expected}; rebuild"
            )
        self.array = arr

    def read_into(self, positions: np.ndarray, out: np.ndarray) -> None:
        """Row gather split across this reader's threads (numpy's take releases the GIL). Positions are
        checked by the Cache, so ``mode="clip"``: with the default "raise" numpy buffers ``out`` (a
        second copy, ≈ 3.8× slower measured on 256 px rows)."""
        step = -(-len(positions) // max(1, self.threads))
        parts = [slice(i, i + step) for i in range(0, len(positions), step)]

        def gather(part: slice) -> None:
            np.take(self.array, positions[part], axis=0, out=out[part], mode="clip")

        self.parallel(gather, parts, out.nbytes)

    def close(self) -> None:
        self.array = None  # type: ignore[assignment]
        self.shutdown_threads()
