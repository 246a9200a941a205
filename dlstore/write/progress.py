"""What ``convert(..., progress=)`` receives: absolute counts. Stages: ``"images"`` (written, per
finished unit, resumed ones included) and, for a URL DEST, ``"upload"`` (bytes); ``done`` never
decreases and reaches ``total`` when the stage ends.

>>> convert("photos/", "cache/", ConvertOptions(size=64), progress=print)    # doctest: +SKIP"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

IMAGES = "images"  # stage: decode + resize + write, in images
UPLOAD = "upload"  # stage: the finished cache to a URL DEST, in bytes


@dataclass(frozen=True)
class ConvertProgress:
    """``done`` of ``total`` ``unit`` (images or bytes) in ``stage`` (``IMAGES`` or ``UPLOAD``)."""

    stage: str
    done: int
    total: int
    unit: str


Progress = Callable[[ConvertProgress], None]


class ProgressCounter:
    """Counts one stage's work, reporting absolute ``ConvertProgress`` (thread-safe; ``done`` at once)."""

    def __init__(self, report: Progress | None, stage: str, unit: str, total: int, done: int = 0) -> None:
        self.report, self.stage, self.unit, self.total, self.done = report, stage, unit, total, done
        self.lock = threading.Lock()
        self.emit()

    def add(self, n: int) -> None:
        with self.lock:
            self.done += n
            self.emit()

    def emit(self) -> None:
        if self.report is not None:
            self.report(ConvertProgress(self.stage, self.done, self.total, self.unit))
