"""Pixels of ``--decode exact`` and ``--decode fast`` against torchvision on real photographs.

The photos are not in the repository (third-party images): extract the sample photos that the
scikit-image and scikit-learn wheels ship, plus matplotlib's grace_hopper.jpg, into a folder::

    pip download scikit-image scikit-learn --no-deps -d /tmp/whl
    python benchmarks/decode_accuracy.py --wheels /tmp/whl --out benchmarks/results/decode_accuracy.json

From each photo it makes the variants a user meets (JPEG re-saves at q75 and q92, grey photos saved
as RGB JPEGs, upscales to camera size, an EXIF orientation 6 copy), then for every ``--size`` compares
dlstore's decode with torchvision ``Resize(size)`` + ``CenterCrop(size)`` on the same file (EXIF
orientation applied, as ``decode_file`` does): worst mean absolute difference over all photos, for
exact and for fast at several DCT margins; then times exact vs fast on the camera-size files.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import PIL
import torchvision
from PIL import Image, ImageOps
from torchvision import transforms

from dlstore.convert import imageops
from dlstore.convert.imageops import decode_file
from dlstore.spec import ImagePolicy

# Photographs in the wheels (skip drawings, charts, text and synthetic test patterns).
WHEEL_PHOTOS = (
    "skimage/data/astronaut.png",
    "skimage/data/camera.png",
    "skimage/data/chelsea.png",
    "skimage/data/coffee.png",
    "skimage/data/coins.png",
    "skimage/data/brick.png",
    "skimage/data/grass.png",
    "skimage/data/gravel.png",
    "skimage/data/moon.png",
    "skimage/data/rocket.jpg",
    "skimage/data/retina.jpg",
    "skimage/data/hubble_deep_field.jpg",
    "skimage/data/motorcycle_left.png",
    "sklearn/datasets/images/china.jpg",
    "sklearn/datasets/images/flower.jpg",
)
SIZES = (32, 48, 64, 96, 128, 160, 192, 224, 256)
CAMERA_LONG_SIDE = 4000


def extract_photos(wheels: Path, into: Path) -> list[Path]:
    into.mkdir(parents=True, exist_ok=True)
    out = []
    for whl in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(whl) as z:
            for name in z.namelist():
                if name in WHEEL_PHOTOS:
                    dest = into / Path(name).name
                    dest.write_bytes(z.read(name))
                    out.append(dest)
    try:
        from matplotlib import cbook

        hopper = into / "grace_hopper.jpg"
        hopper.write_bytes(Path(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)).read_bytes())
        out.append(hopper)
    except ImportError:
        pass
    return sorted(out)


def make_variants(photos: list[Path], work: Path) -> list[Path]:
    """q92 and q75 re-saves (grey as RGB JPEG), a camera-size upscale (q85), an EXIF-6 copy."""
    work.mkdir(parents=True, exist_ok=True)
    out = []
    for p in photos:
        with Image.open(p) as img:
            rgb = img.convert("RGB")
        stem = p.stem
        for q in (92, 75):
            out.append(_save(rgb, work / f"{stem}_q{q}.jpg", quality=q))
        scale = CAMERA_LONG_SIDE / max(rgb.size)
        big = rgb.resize((round(rgb.width * scale), round(rgb.height * scale)), Image.LANCZOS)
        out.append(_save(big, work / f"{stem}_camera_q85.jpg", quality=85))
        exif = Image.Exif()
        exif[imageops.ORIENTATION_TAG] = 6
        out.append(_save(big, work / f"{stem}_camera_exif6.jpg", quality=90, exif=exif))
    return out


def _save(img: Image.Image, path: Path, **kw: Any) -> Path:
    if not path.exists():
        img.save(path, **kw)
    return path


def reference_image(path: Path) -> Image.Image:
    with Image.open(path) as img:
        return (ImageOps.exif_transpose(img) or img).convert("RGB")


def reference(img: Image.Image, size: int) -> np.ndarray:
    return np.asarray(transforms.CenterCrop(size)(transforms.Resize(size)(img)), dtype=np.float32)


def measure_errors(files: list[Path], sizes: tuple[int, ...], margins: list[float]) -> dict[str, Any]:
    """worst[mode][size] = (worst mean abs diff, file, max abs diff of that file)."""
    modes = ["exact"] + [f"fast@{m:g}" for m in margins]
    worst: dict[str, dict[int, tuple[float, str, int]]] = {m: {} for m in modes}
    for path in files:
        ref_img = reference_image(path)
        for size in sizes:
            ref = reference(ref_img, size)
            for mode in modes:
                got = decode_with(path, size, mode).astype(np.float32)
                diff = np.abs(got - ref)
                mean = float(diff.mean())
                if mean >= worst[mode].get(size, (-1.0, "", 0))[0]:
                    worst[mode][size] = (mean, path.name, int(diff.max()))
        print(f"  {path.name}", flush=True)
    return {m: {str(s): list(v) for s, v in w.items()} for m, w in worst.items()}


def decode_with(path: Path, size: int, mode: str) -> np.ndarray:
    if mode == "exact":
        return decode_file(path, ImagePolicy(size=size, decode="exact"))
    imageops.FAST_MARGIN = float(mode.split("@")[1])
    return decode_file(path, ImagePolicy(size=size, decode="fast"))


def measure_speed(files: list[Path], sizes: tuple[int, ...], margin: float, repeats: int) -> dict[str, Any]:
    """Seconds per image (best of ``repeats`` passes) for exact and fast on the camera-size files."""
    imageops.FAST_MARGIN = margin
    out: dict[str, Any] = {}
    for size in sizes:
        row = {}
        for mode in ("exact", "fast"):
            policy = ImagePolicy(size=size, decode=mode)
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                for p in files:
                    decode_file(p, policy)
                best = min(best, (time.perf_counter() - t0) / len(files))
            row[mode] = best
        row["speedup"] = row["exact"] / row["fast"]
        out[str(size)] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheels", type=Path, help="folder with the scikit-image / scikit-learn wheels")
    ap.add_argument("--photos", type=Path, help="or: a folder of photos to use as they are")
    ap.add_argument("--work", type=Path, default=Path("/tmp/dlstore-decode-accuracy"))
    ap.add_argument("--margins", default="1.5,2,3,4")
    ap.add_argument("--chosen", type=float, default=imageops.FAST_MARGIN, help="margin to time")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/decode_accuracy.json"))
    args = ap.parse_args()
    if args.photos:
        photos = sorted(p for p in args.photos.iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
    else:
        photos = extract_photos(args.wheels, args.work / "photos")
    files = make_variants(photos, args.work / "variants")
    margins = [float(m) for m in args.margins.split(",")]
    print(f"{len(photos)} photos, {len(files)} files; errors:", flush=True)
    errors = measure_errors(files, SIZES, margins)
    camera = [f for f in files if "_camera_" in f.name]
    print("timing...", flush=True)
    speed = measure_speed(camera, (64, 224), args.chosen, args.repeats)
    doc = {
        "photos": [p.name for p in photos],
        "files": len(files),
        "sizes": list(SIZES),
        "worst_mean_abs": errors,
        "speed_s_per_image_camera": speed,
        "chosen_margin": args.chosen,
        "versions": {"pillow": PIL.__version__, "torchvision": torchvision.__version__},
        "machine": platform.processor() or platform.machine(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"\nworst mean |diff| vs torchvision over {len(files)} files (levels):")
    print(f"{'mode':>10} " + " ".join(f"{s:>6}" for s in SIZES))
    for mode, row in errors.items():
        print(f"{mode:>10} " + " ".join(f"{row[str(s)][0]:6.2f}" for s in SIZES))
    for size, row in speed.items():
        print(
            f"camera-size JPEG @ {size}: exact {row['exact'] * 1e3:.0f} ms, fast {row['fast'] * 1e3:.0f} ms, "
            f"{row['speedup']:.1f}x"
        )


if __name__ == "__main__":
    main()
