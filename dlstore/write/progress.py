"""What ``convert(..., progress=)`` receives: absolute counts, so a caller can draw a true bar.

A conversion reports two stages: ``"images"`` (images decoded and written, counted per finished unit,
resumed units included from the first event) and, for a URL DEST, ``"upload"`` (bytes uploaded, per
finished object). Within a stage ``done`` never decreases and reaches ``total`` only when the stage's
last piece of work is finished.

>>> def show(p: ConvertProgress) -> None:
...     print(f"{p.stage}: {p.done}/{p.total} {p.unit}")
>>> convert("photos/", "cache/", ConvertOptions(size=64), progress=show)    # doctest: +SKIP
images: 0/40 images
images: 16/40 images
...
"""

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
    """Counts one stage's work and reports each step as an absolute ``ConvertProgress``; safe to call
    from several threads (the upload's). Reports ``done`` at once, so the caller sees the total."""

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
