"""Negative control for the pin-in-place fence (GPU): the same check as
``tests/gpu/test_cuda.py::test_batches_pinned_in_place_are_not_refilled_before_the_device_read_them``,
run once as shipped and once with the fence removed (a released page-locked slot freed at once), to show
that the test's check can see an early refill. Prints one line per mode."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))

from test_cuda import copies_read_from_pinned_slots  # noqa: E402

from dlstore import convert  # noqa: E402
from dlstore.convert.sources import ArraySource  # noqa: E402
from dlstore.read import slots  # noqa: E402


def make_cache(dest: Path, n: int = 300) -> Path:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
    data[:, 0, 0, 0], data[:, 0, 0, 1] = np.arange(n) % 256, np.arange(n) // 256
    src = ArraySource(
        description="t",
        classes=("a", "b"),
        names=[str(i) for i in range(n)],
        labels=rng.integers(0, 2, n),
        kind="test",
        data=data,
    )
    convert(src, dest, format="ram", size=32, resize="stretch", workers=1)
    return dest


def main() -> None:
    cache = make_cache(Path(tempfile.mkdtemp()) / "ram")
    bad, n = copies_read_from_pinned_slots(cache)
    print(f"fence on : {bad} of {n} device batches overwritten before their copy (registered {slots.stats})")
    slots._fence = lambda m: False  # type: ignore[assignment]  # free on release, copy still queued
    bad, n = copies_read_from_pinned_slots(cache)
    print(f"fence off: {bad} of {n} device batches overwritten before their copy")


if __name__ == "__main__":
    main()
