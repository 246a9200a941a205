"""G2, F5: a reader re-opening a cache while other processes replace it (``--overwrite``) with other
options and storage orders gets the old generation whole, the new one whole, or CacheReplacedError,
never labels of one generation with the pixels of another (issue 20 item 2).

Every image's pixels say which class it belongs to (a flat grey level per class), so each label the
reader returns is checked against the pixels at the same index, whatever the storage order, size or
codec of the generation it came from.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dlstore.errors import CacheReplacedError
from dlstore.read.cache import open_cache
from dlstore.write.conversion import convert

LEVELS = (20, 128, 235)  # grey level of each class: far apart enough for any codec and resize
# Options each overwrite cycles through, per format: a mix of sizes, codecs and storage orders.
VARIANTS = {
    "ram": [{"size": 8}, {"size": 12}, {"size": 8, "storage_order": "source"}],
    "npz": [{"size": 8}, {"size": 10, "codec": "deflate"}, {"size": 8, "codec": "jpeg"}],
    "zarr": [{"size": 8}, {"size": 12, "codec": "none"}, {"size": 8, "codec": "jpeg"}],
}
CONVERT = """
import json, sys
from dlstore.write.conversion import convert
from dlstore.errors import ConvertError
src, dest, fmt, opts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
try:
    convert(src, dest, format=fmt, workers=1, overwrite=True, **opts)
except ConvertError as e:  # another converter holds the destination: refused, as it should be
    print("refused:", e)
"""


def class_tree(root: Path, per_class: int = 8) -> Path:
    rng = np.random.default_rng(1)
    for k, level in enumerate(LEVELS):
        (root / f"c{k}").mkdir(parents=True)
        for j in range(per_class):
            noise = rng.integers(-8, 9, (14 + j % 3, 16, 3))
            Image.fromarray(np.clip(level + noise, 0, 255).astype(np.uint8)).save(root / f"c{k}" / f"{j}.png")
    return root


def check_reopen(dest: Path) -> str:
    """Open, read everything, check every label against its pixels; 'ok' or 'replaced'."""
    try:
        cache = open_cache(dest)
        try:
            images = cache.read(np.arange(len(cache)))
            labels = cache.labels.copy()
        finally:
            cache.close()
    except CacheReplacedError:
        return "replaced"
    assert images.shape[1:] == cache.spec.shape
    seen = np.abs(images.reshape(len(images), -1).mean(axis=1)[:, None] - np.asarray(LEVELS)).argmin(axis=1)
    wrong = np.flatnonzero(seen != labels)
    assert wrong.size == 0, f"labels not belonging to their images at indices {wrong.tolist()}"
    return "ok"


def overwrite_loop(src: Path, dest: Path, fmt: str, rounds: int, parallel: int, log: list[str]) -> None:
    """``rounds`` overwrites, ``parallel`` converter processes at a time (most are refused as busy)."""
    variants = VARIANTS[fmt]
    for r in range(0, rounds, parallel):
        procs = []
        for i in range(r, min(rounds, r + parallel)):
            opts = {**variants[i % len(variants)], "seed": i}
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", CONVERT, str(src), str(dest), fmt, json.dumps(opts)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        for p in procs:
            out, _ = p.communicate(timeout=300)
            log.append(f"rc={p.returncode} {out.strip()[-300:]}")


def race(tmp_path: Path, fmt: str, rounds: int, parallel: int, min_opens: int) -> dict[str, int]:
    src = class_tree(tmp_path / "src")
    dest = tmp_path / "cache"
    convert(src, dest, format=fmt, size=8, workers=1)
    log: list[str] = []
    writer = threading.Thread(target=overwrite_loop, args=(src, dest, fmt, rounds, parallel, log))
    writer.start()
    counts = {"ok": 0, "replaced": 0}
    try:
        while writer.is_alive() or counts["ok"] + counts["replaced"] < min_opens:
            counts[check_reopen(dest)] += 1
    finally:
        writer.join()
    assert all(line.startswith("rc=0") for line in log), log  # refused or done, never a crash
    replaced = [line for line in log if "refused" not in line]
    assert len(replaced) >= -(-rounds // parallel), log  # at least one replace per round went through
    assert counts["ok"] + counts["replaced"] >= min_opens
    return counts


@pytest.mark.parametrize("fmt", list(VARIANTS))
def test_reopening_during_overwrites_never_mixes_generations(tmp_path: Path, fmt: str) -> None:
    race(tmp_path, fmt, rounds=3, parallel=1, min_opens=20)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(VARIANTS))
def test_2000_reopens_during_20_concurrent_overwrites(tmp_path: Path, fmt: str) -> None:
    t0 = time.monotonic()
    counts = race(tmp_path, fmt, rounds=20, parallel=4, min_opens=2000)
    print(fmt, counts, f"{time.monotonic() - t0:.0f} s")


def test_a_cache_swapped_during_open_is_opened_whole_or_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deterministic form of the race: the swap lands between reading the labels and the positions
    (another storage order), where the reader that mixed them returned labels of other images."""
    import dlstore.read.cache as cache_mod

    src = class_tree(tmp_path / "src", per_class=4)
    dest = tmp_path / "cache"
    convert(src, dest, format="ram", size=8, workers=1, storage_order="source")
    convert(src, tmp_path / "other", format="ram", size=8, workers=1, seed=5)  # another order
    real = cache_mod.load_positions
    swaps = []

    def swapping_load_positions(*args, **kw):  # type: ignore[no-untyped-def]
        if not swaps:  # once: dest becomes the other generation under the open
            swaps.append(1)
            (tmp_path / "cache").rename(tmp_path / "old")
            (tmp_path / "other").rename(tmp_path / "cache")
        return real(*args, **kw)

    monkeypatch.setattr(cache_mod, "load_positions", swapping_load_positions)
    assert check_reopen(dest) == "ok"  # the labels of the held generation, then re-opened whole
    assert swaps
