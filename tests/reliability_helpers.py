"""Helpers for the reliability tests: small trees, small units, cache comparison."""

from __future__ import annotations

import dataclasses
import io
import os
import signal
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dlstore.formats import FORMATS
from dlstore.read.cache import open_cache
from dlstore.spec import ImagePolicy
from dlstore.write.sources import FolderSource

FORMAT_NAMES = list(FORMATS)


def make_tree(
    root: Path, per_class: int = 12, classes: tuple[str, ...] = ("a", "b"), seed: int = 0, side: int = 24
) -> Path:
    """A small ImageFolder tree of PNG and JPEG files with distinct random content."""
    rng = np.random.default_rng(seed)
    for cls in classes:
        (root / cls).mkdir(parents=True, exist_ok=True)
        for j in range(per_class):
            arr = rng.integers(0, 256, (side, side + j % 5, 3), dtype=np.uint8)
            suffix = ".png" if j % 2 else ".jpg"
            Image.fromarray(arr).save(root / cls / f"img{j:03d}{suffix}")
    return root


def image_bytes(arr: np.ndarray, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt, **kw)
    return buf.getvalue()


def small_units(monkeypatch: pytest.MonkeyPatch, unit: int = 5) -> None:
    """Every format writes units of ``unit`` images, so a tiny tree still has many units."""
    for fmt in FORMATS.values():
        monkeypatch.setattr(fmt.writer, "choose_unit_size", staticmethod(lambda image_bytes: unit))


def release_loader(error: pytest.ExceptionInfo[BaseException]) -> None:
    """Let the DataLoader iterator an error was raised from shut its workers down now.

    The raised exception's traceback holds that iterator in a reference cycle, so the cyclic collector frees
    it later, in whichever test happens to trigger a collection; it closes the iterator's index queues
    before the iterator's ``__del__`` sends its workers the signal to stop, and each worker then sits out
    torch's 5 s join timeout (10 s for 2 workers, charged to an unrelated test). Clearing the traceback's
    frames drops the last references at once, while the queues still work."""
    traceback.clear_frames(error.tb)


def read_all(path: Path) -> tuple[np.ndarray, np.ndarray]:
    cache = open_cache(path, check_source=False)
    try:
        return cache.read(np.arange(len(cache))), cache.labels.copy()
    finally:
        cache.close()


def assert_same_cache(a: Path, b: Path) -> None:
    ia, la = read_all(a)
    ib, lb = read_all(b)
    assert np.array_equal(la, lb) and np.array_equal(ia, ib)


@dataclasses.dataclass
class HangingSource(FolderSource):
    """A folder source whose decoding of the file ``hang`` sleeps 30 s (a decoder that hangs). At module
    level, so that Dask workers and the processes they start can unpickle it by reference."""

    hang: str = ""

    @classmethod
    def of(cls, src: FolderSource, hang: str) -> HangingSource:
        return cls(**{f.name: getattr(src, f.name) for f in dataclasses.fields(src)}, hang=hang)

    def decode(self, i: int, policy: ImagePolicy, data: bytes | None = None) -> np.ndarray:
        if self.names[i] == self.hang:
            time.sleep(30)
        return super().decode(i, policy, data)


@dataclasses.dataclass
class KillingSource(FolderSource):
    """A folder source whose decoding of the file ``kill`` kills -9 the process named by ``victim``
    ("worker": the Dask worker that runs the unit; "decoder": the decode process itself), once: the
    first to create the ``marker`` file does it. A real process really killed mid-convert (F6)."""

    kill: str = ""
    victim: str = "worker"
    marker: str = ""

    @classmethod
    def of(cls, src: FolderSource, kill: str, victim: str, marker: Path) -> KillingSource:
        fields = {f.name: getattr(src, f.name) for f in dataclasses.fields(src)}
        return cls(**fields, kill=kill, victim=victim, marker=str(marker))

    def decode(self, i: int, policy: ImagePolicy, data: bytes | None = None) -> np.ndarray:
        if self.names[i] == self.kill and self._first():
            if self.victim != "nobody":  # "nobody": only hang, for a test to interrupt the run
                os.kill(self._victim_pid(), signal.SIGKILL)
            time.sleep(30)  # the decoder was killed with its worker, or the worker kills it
        return super().decode(i, policy, data)

    def _first(self) -> bool:
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True

    def _victim_pid(self) -> int:
        import multiprocessing as mp

        parent = mp.parent_process()  # a decode process's parent is its Dask worker
        if self.victim == "decoder" or parent is None:
            return os.getpid()  # in a worker's task thread (no decode process): the worker itself
        return parent.pid
