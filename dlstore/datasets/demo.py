"""A deterministic synthetic image dataset (demos, tests, benchmarks), generated from
``(index, label, seed)``. Images look like photographs to a JPEG codec (gradients, edges, texture,
noise: ~20-60 kB JPEGs); each class has a hue and a shape family, so a small CNN can learn them at
32-64 px. Only numpy and Pillow: usable (and forkable) without torch."""

from __future__ import annotations

import colorsys
import functools
import io
import json
import logging
import multiprocessing
import os
import shutil
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from dlstore import settings
from dlstore.machine import process_alive, usable_cores

__all__ = [
    "DEMO_CLASSES",
    "DEMO_JPEG_QUALITY",
    "default_demo_dir",
    "demo_jpeg_bytes",
    "demo_relpath",
    "ensure_demo",
    "make_demo_image",
]

# Sorted alphabetically on purpose: torchvision's ImageFolder numbers classes by
# sorted folder name, so label ``i`` here is class index ``i`` there.
DEMO_CLASSES: tuple[str, ...] = (
    "amber_discs",
    "blue_stripes",
    "green_polygons",
    "rose_rings",
    "violet_stars",
)
# Dominant hue per class (HSV hue in [0, 1)); neighbours are 0.14-0.3 apart and the
# per-image jitter below makes hue distributions overlap.
_CLASS_HUES: tuple[float, ...] = (0.09, 0.60, 0.31, 0.95, 0.77)
_HUE_JITTER = 0.10

DEMO_JPEG_QUALITY = 90
# Bump when the generator changes: it is part of the default cache dir name and the
# marker, so a cache written by an older generator is never mistaken for this one.
_DEMO_VERSION = 1
_MARKER_NAME = ".dlstore-demo-complete"

_RGB = tuple[int, int, int]
# Generating takes about 20 ms an image per core (11 s for 512 on 2 cores): without a word the first
# ``make demo`` sits silent. A line when it starts, one every PROGRESS_EVERY_S, one when it is done;
# the CLI shows the ``dlstore`` logger on stderr.
PROGRESS_EVERY_S = 5.0
_log = logging.getLogger(__name__)


def _clamp01(x: float) -> float:
    return min(1.0, max(0.0, x))


def _hsv(h: float, s: float, v: float) -> _RGB:
    # colorsys is pure Python, hence bit-reproducible everywhere.
    r, g, b = colorsys.hsv_to_rgb(h % 1.0, _clamp01(s), _clamp01(v))
    return (round(r * 255), round(g * 255), round(b * 255))


def _class_colour(rng: np.random.Generator, hue: float) -> _RGB:
    """A colour near the class hue, with varied saturation and brightness."""
    h = hue + rng.normal(0.0, _HUE_JITTER)
    return _hsv(h, rng.uniform(0.35, 0.95), rng.uniform(0.35, 0.98))


def _random_colour(rng: np.random.Generator) -> _RGB:
    """Any hue: used for distractors so colour alone is not a perfect label."""
    return _hsv(rng.uniform(0.0, 1.0), rng.uniform(0.1, 0.8), rng.uniform(0.2, 0.95))


def _image_size(rng: np.random.Generator) -> tuple[int, int]:
    """(width, height): mostly landscape ~400x300, about one in six portrait."""
    w, h = int(rng.integers(360, 461)), int(rng.integers(270, 346))
    if rng.random() < 0.17:
        w, h = h, w
    return w, h


def _bbox(rng: np.random.Generator, w: int, h: int, lo: float, hi: float) -> list[float]:
    """A random box whose size is a fraction [lo, hi) of the short image side."""
    side = min(w, h)
    bw, bh = rng.uniform(lo, hi, size=2) * side
    x0, y0 = rng.uniform(-0.1 * bw, w - 0.9 * bw), rng.uniform(-0.1 * bh, h - 0.9 * bh)
    return [float(x0), float(y0), float(x0 + bw), float(y0 + bh)]


def _polygon(
    rng: np.random.Generator, box: Sequence[float], n: int, spiky: bool
) -> list[tuple[float, float]]:
    """Vertices around the box centre; ``spiky`` alternates radii to make a star."""
    cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    rx, ry = (box[2] - box[0]) / 2, (box[3] - box[1]) / 2
    if spiky:  # evenly spaced points so the star's arms alternate cleanly
        angles = np.linspace(0.0, 2 * np.pi, n, endpoint=False) + rng.uniform(0.0, np.pi)
    else:  # sorted random angles: always a simple (non self-intersecting) polygon
        angles = np.sort(rng.uniform(0.0, 2 * np.pi, size=n))
    radii = rng.uniform(0.6, 1.0, size=n)
    if spiky:
        radii[1::2] *= 0.4
    return [(float(cx + rx * r * np.cos(a)), float(cy + ry * r * np.sin(a))) for a, r in zip(angles, radii)]


def _smooth_field(rng: np.random.Generator, w: int, h: int, cells: int) -> np.ndarray:
    """Band-limited noise in [-1, 1]-ish: a coarse random grid upsampled bicubically."""
    gw, gh = max(2, w // cells), max(2, h // cells)
    coarse = rng.normal(0.0, 1.0, size=(gh, gw)).astype(np.float32)
    return np.asarray(Image.fromarray(coarse).resize((w, h), Image.Resampling.BICUBIC))


def _background(rng: np.random.Generator, w: int, h: int, hue: float) -> Image.Image:
    """Low-frequency colour field ("sky", "wall", "out-of-focus scenery")."""
    gw, gh = int(rng.integers(3, 8)), int(rng.integers(3, 7))
    grid = np.empty((gh, gw, 3), dtype=np.uint8)
    for y in range(gh):
        for x in range(gw):
            # partly class-tinted: a hint, not a giveaway (mean colour alone must not reach a CNN's accuracy)
            grid[y, x] = _class_colour(rng, hue) if rng.random() < 0.4 else _random_colour(rng)
    return Image.fromarray(grid).resize((w, h), Image.Resampling.BICUBIC)


def _shape_mask(rng: np.random.Generator, family: int, w: int, h: int) -> Image.Image:
    """An 'L' mask of one shape from ``family`` (index into DEMO_CLASSES)."""
    mask = Image.new("L", (w, h), 0)
    draw = ImageDraw.Draw(mask)
    box = _bbox(rng, w, h, 0.15, 0.55)
    name = DEMO_CLASSES[family]
    if name == "amber_discs":
        draw.ellipse(box, fill=255)
    elif name == "rose_rings":
        draw.ellipse(box, outline=255, width=int(rng.integers(4, 14)))
    elif name == "green_polygons":
        draw.polygon(_polygon(rng, box, int(rng.integers(3, 7)), spiky=False), fill=255)
    elif name == "violet_stars":
        draw.polygon(_polygon(rng, box, 2 * int(rng.integers(4, 7)), spiky=True), fill=255)
    else:  # blue_stripes: a patch whose stripes are painted by _stripe_fill
        (draw.rectangle if rng.random() < 0.5 else draw.ellipse)(box, fill=255)
    return mask


def _stripe_fill(rng: np.random.Generator, w: int, h: int, a: _RGB, b: _RGB) -> Image.Image:
    """A near-square-wave grating of two colours at a random angle and period."""
    period, theta = rng.uniform(6.0, 18.0), rng.uniform(0.0, np.pi)
    k = np.float32(2 * np.pi / period)
    # Outer sum instead of a full mgrid: the phase is linear in x and y.
    xs = np.arange(w, dtype=np.float32) * (k * np.float32(np.cos(theta)))
    ys = np.arange(h, dtype=np.float32) * (k * np.float32(np.sin(theta)))
    phase = ys[:, None] + xs[None, :] + np.float32(rng.uniform(0.0, 2 * np.pi))
    # Steep clipped sine: sharp edges, but anti-aliased like a real photo.
    t = (np.clip(np.sin(phase) * 3.0, -1.0, 1.0) * 0.5 + 0.5)[..., None]
    out = np.asarray(b, np.float32) + (np.asarray(a, np.float32) - np.asarray(b, np.float32)) * t
    return Image.fromarray(np.round(out).astype(np.uint8))


def _paint_shape(rng: np.random.Generator, img: Image.Image, family: int, colour: _RGB, second: _RGB) -> None:
    """Paint one shape into ``img`` in place, working only on its bounding box."""
    w, h = img.size
    mask = _shape_mask(rng, family, w, h)
    radius = float(rng.uniform(1.5, 5.0)) if rng.random() < 0.35 else 0.0
    box = mask.getbbox()
    if box is None:
        return  # shape fell entirely outside the image
    # 3 sigma: the blurred edge is not cut at the crop border
    pad = int(np.ceil(3 * radius))
    box = (max(0, box[0] - pad), max(0, box[1] - pad), min(w, box[2] + pad), min(h, box[3] + pad))
    mask = mask.crop(box)
    if radius > 0:  # out of focus: soft edges like shallow depth of field
        mask = mask.filter(ImageFilter.GaussianBlur(radius))
    striped = DEMO_CLASSES[family] == "blue_stripes"
    fill = _stripe_fill(rng, *mask.size, colour, second) if striped else Image.new("RGB", mask.size, colour)
    img.paste(fill, box[:2], mask)


def _paint_shapes(rng: np.random.Generator, img: Image.Image, label: int) -> Image.Image:
    """3-7 class-family shapes, mostly in class colours, plus 1-3 distractors."""
    hue = _CLASS_HUES[label]
    n_own = int(rng.integers(3, 8))
    n_other = int(rng.integers(1, 4))
    families = [label] * n_own + [int(f) for f in rng.integers(0, len(DEMO_CLASSES), n_other)]
    order = rng.permutation(len(families))  # distractors may sit on top or below
    for k in order:
        # own shapes usually (not always) in class colours: high accuracy needs the shape family too
        tinted = k < n_own and rng.random() < 0.8
        colour = _class_colour(rng, hue) if tinted else _random_colour(rng)
        second = _class_colour(rng, hue) if tinted else _random_colour(rng)
        _paint_shape(rng, img, families[k], colour, second)
    return img


def _add_texture(rng: np.random.Generator, arr: np.ndarray) -> np.ndarray:
    """Fine band-limited texture ("foliage", "fabric") inside a few soft regions."""
    h, w, _ = arr.shape
    for _ in range(int(rng.integers(1, 4))):
        x0, y0, x1, y1 = (int(round(v)) for v in _bbox(rng, w, h, 0.3, 0.9))
        x0, y0, x1, y1 = max(0, x0), max(0, y0), min(w, x1), min(h, y1)
        if x1 - x0 < 8 or y1 - y0 < 8:
            continue
        # soft-edged ellipse drawn at 1/8 scale and upsampled: far cheaper than a large blur
        rw, rh = x1 - x0, y1 - y0
        small = Image.new("L", (max(2, rw // 8), max(2, rh // 8)), 0)
        ImageDraw.Draw(small).ellipse((0, 0, small.width - 1, small.height - 1), fill=255)
        region = small.resize((rw, rh), Image.Resampling.BILINEAR)
        weight = np.asarray(region, np.float32)[..., None] * np.float32(1 / 255)
        tex = _smooth_field(rng, rw, rh, cells=int(rng.integers(2, 5)))[..., None]
        tint = rng.uniform(0.7, 1.0, size=3).astype(np.float32)  # mostly luminance
        amp = np.float32(rng.uniform(6.0, 14.0))
        arr[y0:y1, x0:x1] += weight * tex * (tint * amp)
    return arr


def _add_lighting(rng: np.random.Generator, arr: np.ndarray) -> np.ndarray:
    """Slow multiplicative illumination so flat fills become gentle gradients."""
    h, w, _ = arr.shape
    light = 1.0 + 0.18 * _smooth_field(rng, w, h, cells=max(w, h) // 3)
    return arr * light[..., None]


def _add_sensor_noise(rng: np.random.Generator, arr: np.ndarray) -> np.ndarray:
    """Gaussian noise, partly shared across channels like demosaiced sensor noise."""
    sigma = np.float32(rng.uniform(3.0, 6.0))
    # float32 ziggurat: several times faster than float64, on the biggest array drawn
    lum = rng.standard_normal(arr.shape[:2], dtype=np.float32)[..., None] * (sigma * np.float32(0.8))
    chroma = rng.standard_normal(arr.shape, dtype=np.float32) * (sigma * np.float32(0.6))
    arr += lum
    arr += chroma
    return arr


def make_demo_image(index: int, label: int, seed: int = 0) -> Image.Image:
    """Demo image ``index`` of class ``label``: all randomness from ``default_rng((seed, index))``, so the
    same arguments give the same pixels (and JPEG bytes, for a fixed Pillow/numpy)."""
    if not 0 <= label < len(DEMO_CLASSES):
        raise ValueError(f"label must be in [0, {len(DEMO_CLASSES)}), got {label}")
    if index < 0 or seed < 0:
        raise ValueError(f"index and seed must be >= 0, got index={index} seed={seed}")
    rng = np.random.default_rng((seed, index))
    w, h = _image_size(rng)
    img = _background(rng, w, h, _CLASS_HUES[label])
    img = _paint_shapes(rng, img, label)
    arr = np.array(img, dtype=np.float32)  # a fresh writable copy: layers add in place
    arr = _add_sensor_noise(rng, _add_lighting(rng, _add_texture(rng, arr)))
    return Image.fromarray(np.clip(np.round(arr), 0, 255).astype(np.uint8))


def demo_jpeg_bytes(index: int, label: int, seed: int = 0) -> bytes:
    """The exact bytes ``ensure_demo`` writes for this image."""
    buf = io.BytesIO()
    make_demo_image(index, label, seed).save(buf, format="JPEG", quality=DEMO_JPEG_QUALITY)
    return buf.getvalue()


def default_demo_dir(n_images: int = 512, seed: int = 0) -> Path:
    """A versioned per-(n, seed) folder under ``$DLSTORE_DEMO_DIR`` if set, else under ~/.cache/dlstore,
    so demos of different sizes never collide."""
    base = settings.folder("DLSTORE_DEMO_DIR", "")
    return base / f"demo-v{_DEMO_VERSION}-n{n_images}-s{seed}"


def demo_relpath(index: int) -> str:
    """Path of image ``index`` relative to the dataset root (round-robin labels)."""
    return f"{DEMO_CLASSES[index % len(DEMO_CLASSES)]}/{index:06d}.jpg"


def ensure_demo(
    root: Path | None = None,
    n_images: int = 512,
    seed: int = 0,
    workers: int | None = None,
) -> Path:
    """The demo dataset in ImageFolder layout (``root/<class>/<index:06d>.jpg``, label ``i % n_classes``),
    generated unless complete: into a unique sibling temp dir, marker last, renamed into place, so a
    reader never sees a half-written dataset."""
    if n_images < 1:
        raise ValueError(f"n_images must be >= 1, got {n_images}")
    root = Path(root).expanduser() if root is not None else default_demo_dir(n_images, seed)
    if _is_complete(root, n_images, seed):
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp_dirs(root)
    # Not tempfile.mkdtemp: its 0700 would make a shared cache unreadable to other users.
    tmp = root.parent / f".{root.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        _generate_into(tmp, n_images, seed, workers)
        _write_marker(tmp, n_images, seed)
        _publish(tmp, root, n_images, seed)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root


def _marker_payload(n_images: int, seed: int) -> dict[str, object]:
    return {"version": _DEMO_VERSION, "n_images": n_images, "seed": seed, "classes": list(DEMO_CLASSES)}


def _write_marker(directory: Path, n_images: int, seed: int) -> None:
    (directory / _MARKER_NAME).write_text(json.dumps(_marker_payload(n_images, seed)) + "\n")


def _is_complete(root: Path, n_images: int, seed: int) -> bool:
    """``root`` holds a finished dataset with these parameters; one with others is an error (not a
    silent regeneration: ``$DLSTORE_DEMO_DIR`` is likely shared between configs)."""
    try:
        found = json.loads((root / _MARKER_NAME).read_text())
    except (OSError, ValueError):  # missing or unreadable: regenerate
        return False
    expected = _marker_payload(n_images, seed)
    if found != expected:
        raise ValueError(f"{root} holds a different demo dataset: marker {found}, wanted {expected}")
    return True


def _publish(tmp: Path, root: Path, n_images: int, seed: int) -> None:
    """Atomically rename the finished ``tmp`` to ``root``, coping with races."""
    for _ in range(3):
        try:
            os.rename(tmp, root)  # atomic; fails if root is a non-empty dir
            return
        except OSError:
            pass
        if _is_complete(root, n_images, seed):
            shutil.rmtree(tmp, ignore_errors=True)  # a concurrent run won the race
            return
        # ``root`` is incomplete (not ours: we rename only complete dirs): moved aside atomically, so a
        # concurrent reader never sees it half-deleted, then retry.
        trash = root.parent / f".{root.name}.trash-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        try:
            os.rename(root, trash)
        except FileNotFoundError:
            continue
        shutil.rmtree(trash, ignore_errors=True)
    raise OSError(f"could not move {tmp} into place at {root}")


def _remove_stale_tmp_dirs(root: Path) -> None:
    """Temp/trash dirs left by killed runs (their process is gone), of any demo size; a live
    generator's are kept."""
    for pattern in (".*.tmp-*-*", ".*.trash-*-*"):
        for path in root.parent.glob(pattern):
            if not _pid_alive(path.name):
                shutil.rmtree(path, ignore_errors=True)


def _pid_alive(name: str) -> bool:
    """Whether the process whose pid a temp dir's name carries (``.NAME.tmp-PID-HEX``) still runs."""
    try:
        return process_alive(int(name.rsplit("-", 2)[-2]))
    except ValueError:
        return False


def _write_one(directory: str, seed: int, index: int) -> int:
    """Generate and write one image; module-level so pool workers can pickle it."""
    data = demo_jpeg_bytes(index, index % len(DEMO_CLASSES), seed)
    with open(os.path.join(directory, demo_relpath(index)), "wb") as f:
        f.write(data)
    return len(data)


class _Progress:
    """Says that the demo images are being generated, how far it got every PROGRESS_EVERY_S, and when done."""

    def __init__(self, n_images: int, workers: int) -> None:
        self.n_images, self.done = n_images, 0
        self.t0 = self.last = time.perf_counter()
        process = "process" if workers == 1 else "processes"
        _log.info(
            "generating %d demo images on %d %s (once; later runs reuse them) …", n_images, workers, process
        )

    def tick(self) -> None:
        self.done += 1
        now = time.perf_counter()
        if now - self.last >= PROGRESS_EVERY_S and self.done < self.n_images:
            self.last = now
            _log.info("demo images: %d of %d written (%.0f s)", self.done, self.n_images, now - self.t0)

    def finish(self) -> None:
        _log.info("generated %d demo images in %.1f s", self.n_images, time.perf_counter() - self.t0)


def _generate_into(directory: Path, n_images: int, seed: int, workers: int | None) -> None:
    for name in DEMO_CLASSES:
        (directory / name).mkdir()
    n_workers = min(workers if workers is not None else usable_cores(), n_images)
    job = functools.partial(_write_one, str(directory), seed)
    progress = _Progress(n_images, max(1, n_workers))
    if n_workers <= 1:
        for i in range(n_images):
            job(i)
            progress.tick()
    else:
        # fork on Linux: no re-import of __main__; the workers use only numpy and Pillow (safe beside torch).
        ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else None)
        # Results come back a chunk at a time: chunks of at most 8 images (about half a second on a busy
        # core) keep the progress lines on their 5 s beat (larger chunks leave long silences).
        chunksize = max(1, min(8, n_images // (n_workers * 8)))
        with ctx.Pool(n_workers) as pool:
            for _ in pool.imap_unordered(job, range(n_images), chunksize=chunksize):
                progress.tick()
    progress.finish()
