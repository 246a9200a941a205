"""Durable file writes, the one home for them: a file is either absent, the old one or the complete
new one, and fsynced before anyone records it as written (the journal, the manifest)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import numpy as np


def temp_name(path: Path) -> Path:
    """Hidden and ending in ``.tmpPID``: the converter removes such leftovers of a killed writer."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


@contextmanager
def durable_file(path: Path, sync_dir: bool = False) -> Iterator[BinaryIO]:
    """Write through a temp name in the same folder; on a clean exit fsync, rename over ``path`` and
    (``sync_dir``) fsync the folder so the rename itself survives a crash. On an error the temp file
    is removed and ``path`` is untouched."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if sync_dir:
        fsync_path(path.parent)


def write_bytes_durably(path: Path, data: bytes | memoryview, sync_dir: bool = False) -> None:
    with durable_file(path, sync_dir) as f:
        f.write(data)


def write_json_durably(path: Path, text: str) -> None:
    """Small metadata (manifest, journal files): the folder is fsynced too."""
    write_bytes_durably(path, text.encode("utf-8"), sync_dir=True)


def save_npy_durably(path: Path, array: np.ndarray) -> None:
    with durable_file(path) as f:
        np.save(f, array, allow_pickle=False)


def fsync_path(path: Path) -> None:
    """fsync a file or a folder by path (a folder's fsync makes its entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(root: Path) -> None:
    """Every file and folder under root, deepest first, then root itself."""
    for p in sorted(Path(root).rglob("*"), key=lambda q: -len(q.parts)):
        fsync_path(p)
    fsync_path(root)
