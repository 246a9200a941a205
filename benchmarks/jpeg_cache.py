"""Issue 10 targets (JPEG cache, GPU decode, ragged GPU crop), side by side in one run on the H200, and
issue 27's decode lanes (``lanes_*`` sections: each lane alone and together, the measured split vs fixed
ones, the hardware lane's pixels).

    python benchmarks/jpeg_cache.py --out OUTDIR [--images 8192] [--steps 30] [--sections all]

Photographs: crops of the real photos bundled with scikit-image (``skimage.data``), resized to about
460×345 (portrait and landscape) and saved as q95 JPEGs in an ImageFolder tree. From them: a raw ``ram``
cache (256² crop), a JPEG q90 cache of the same 256² crops (bytes and error vs raw), and JPEG q90
``--resize shorter`` caches at 256 (and 128) for training with the GPU RandomResizedCrop.

Writes OUTDIR/jpeg_cache.json (every number, environment, protocol) and OUTDIR/targets.json, then prints
a table. Each section is recorded as it finishes; a failing section does not stop the others.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from dlstore import (
    CachedDataset,  # noqa: E402
    open_cache,  # noqa: E402
)
from dlstore.formats.codecs import get_codec  # noqa: E402
from dlstore.gpu import GpuAugment, RaggedRandomResizedCrop  # noqa: E402
from dlstore.read import (
    DecodeLoader,  # noqa: E402
    PinnedLoader,  # noqa: E402
)
from dlstore.read.hw_decode import HardwareJpeg  # noqa: E402

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "retina")
RESULTS: dict[str, Any] = {}
TARGETS = harness.Targets()
CORES = len(os.sched_getaffinity(0))
# cpu only for a dry run of the script on a machine without a GPU (tiny sizes; the numbers mean nothing)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


log, sync = harness.log, harness.sync
target = TARGETS.add


# --- data -------------------------------------------------------------------------------------------


def _photo_arrays() -> list[np.ndarray]:
    import skimage.data

    out = []
    for name in PHOTOS:
        try:
            img = np.asarray(getattr(skimage.data, name)())
        except Exception as e:  # a photo that needs a download: skip it
            log(f"skimage.data.{name}: {e}")
            continue
        if img.ndim == 3 and img.shape[2] >= 3 and img.dtype == np.uint8:
            out.append(np.ascontiguousarray(img[:, :, :3]))
    return out


def _write_crops(job: tuple[int, int, str]) -> None:
    from PIL import Image

    start, stop, root = job
    photos = _photo_arrays()
    rng = np.random.default_rng(start)
    for i in range(start, stop):
        src = photos[i % len(photos)]
        h, w = src.shape[:2]
        side = rng.uniform(0.5, 1.0) * min(h, w)  # at most ~2x upscaling of the smallest photo
        aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        ch, cw = int(min(h, side / np.sqrt(aspect))), int(min(w, side * np.sqrt(aspect)))
        top, left = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
        crop = Image.fromarray(src[top : top + ch, left : left + cw])
        long_side = 460
        size = (long_side, int(long_side * ch / cw)) if cw >= ch else (int(long_side * cw / ch), long_side)
        crop = crop.resize(size, Image.BILINEAR)
        if rng.random() < 0.5:
            crop = crop.transpose(Image.FLIP_LEFT_RIGHT)
        cls = Path(root) / f"class{i % 10}"
        cls.mkdir(parents=True, exist_ok=True)
        crop.save(cls / f"{i:06d}.jpg", quality=95)


def section_data(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    photos = work / "photos"
    t0 = time.perf_counter()
    try:
        import skimage.data  # noqa: F401

        source = "skimage.data photos"
    except ImportError:  # the machine lacks scikit-image: dlstore's demo images instead (say so)
        source = "dlstore demo images (scikit-image not installed)"
    if source.startswith("skimage"):
        step = -(-args.images // CORES)
        jobs = [(a, min(args.images, a + step), str(photos)) for a in range(0, args.images, step)]
        with mp.get_context("fork").Pool(CORES) as pool:
            pool.map(_write_crops, jobs)
    else:
        from dlstore.datasets.demo import ensure_demo

        ensure_demo(photos, n_images=args.images, workers=CORES)
    log(f"source: {source}")
    out: dict[str, Any] = {
        "source": source,
        "photos": [p for p in PHOTOS],
        "images": args.images,
        "make_s": time.perf_counter() - t0,
        "source_bytes_per_image": sum(p.stat().st_size for p in photos.rglob("*.jpg")) / args.images,
    }
    caches = {
        "raw256": {"format": "ram", "size": 256},
        "jpeg256": {"format": "npz", "size": 256, "codec": "jpeg", "writer_options": {"quality": 90}},
        "jpeg_short256": {"format": "npz", "size": 256, "codec": "jpeg", "resize": "shorter"},
        "jpeg_short128": {"format": "npz", "size": 128, "codec": "jpeg", "resize": "shorter"},
        "zarr_jpeg_short256": {"format": "zarr", "size": 256, "codec": "jpeg", "resize": "shorter"},
    }
    wanted = set(args.caches.split(",")) if args.caches != "all" else set(caches)
    for name, kw in caches.items():
        if name not in wanted:
            continue
        r = harness.convert_cache(photos, work / name, workers=CORES, **kw)  # type: ignore[arg-type]
        out[name] = {"images_per_s": r.images_per_s, "seconds": r.seconds, "bytes_on_disk": r.bytes_on_disk}
        log(f"converted {name}: {r.images_per_s:,.0f} img/s")
    return out


# --- bytes and error ----------------------------------------------------------------------------------


def payload_bytes(cache: Any) -> int:
    reader = cache.reader
    total = 0
    for k in range(-(-cache.spec.n_stored // reader.unit)):
        unit = reader.payload_unit(k)
        total += int(np.sum((unit.ends if unit.ends is not None else unit.offsets[1:]) - unit.offsets[:-1]))
    return total


def section_bytes(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    raw, jpeg = open_cache(work / "raw256"), open_cache(work / "jpeg256")
    n = len(raw)
    idx = np.arange(n)
    out: dict[str, Any] = {"raw_bytes_per_image": raw.spec.image_bytes}
    for name in ("jpeg256", "jpeg_short256", "jpeg_short128", "zarr_jpeg_short256"):
        if not (work / name).exists():  # not built this run (--caches)
            continue
        c = open_cache(work / name)
        out[name] = {
            "payload_bytes_per_image": payload_bytes(c) / len(c),
            "cache_bytes_per_image": sum(p.stat().st_size for p in (work / name).rglob("*") if p.is_file())
            / len(c),
            "recorded_mean_abs_error": c.spec.format_options.get("mean_abs_error"),
        }
    diffs = []
    for a in range(0, n, 512):
        r = raw.read(idx[a : a + 512]).astype(np.int16)
        j = np.stack(jpeg.read_images(idx[a : a + 512])).astype(np.int16)
        diffs.append(np.abs(r - j).mean())
    out["jpeg256_vs_raw_mean_abs_pillow"] = float(np.mean(diffs))
    if True:  # nvJPEG on the GPU (torchvision CPU decode in a dry run)
        from dlstore.read.gpu_decode import decode_on_device

        sel = idx[:1024]
        payloads, shapes = jpeg.read_payloads(sel)
        imgs, fb = decode_on_device(jpeg, payloads, shapes, jpeg.positions[sel], torch.device(DEV))
        gpu = torch.stack(imgs).permute(0, 2, 3, 1).cpu().numpy().astype(np.int16)
        out["jpeg256_vs_raw_mean_abs_nvjpeg"] = float(np.abs(gpu - raw.read(sel).astype(np.int16)).mean())
        out["nvjpeg_fallbacks"] = fb
    per = out["jpeg256"]["payload_bytes_per_image"]
    target(
        "jpeg: bytes/image q90 256px photos vs raw (at most 1/10)",
        per,
        raw.spec.image_bytes,
        0.1,
        higher=False,
    )
    target(
        "jpeg: cache vs raw mean abs error at q90 (levels, at most 3)",
        out["jpeg256_vs_raw_mean_abs_pillow"],
        1.0,
        3.0,
        note=f"manifest's sampled estimate {out['jpeg256']['recorded_mean_abs_error']}",
        higher=False,
    )
    return out


# --- decode -------------------------------------------------------------------------------------------


def section_decode(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from torchvision.io import decode_jpeg

    out: dict[str, Any] = {}
    cache = open_cache(work / "jpeg256")
    n = len(cache) // 256 * 256
    payloads, _ = cache.read_payloads(np.arange(n))
    tensors = [torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in payloads]
    batches = [tensors[a : a + 256] for a in range(0, n, 256)]

    def bare(passes: int) -> float:
        decode_jpeg(batches[0], device=DEV)
        sync()
        t0 = time.perf_counter()
        for _ in range(passes):
            for b in batches:
                decode_jpeg(b, device=DEV)
        sync()
        return passes * n / (time.perf_counter() - t0)

    def loader_rate(path: str, transform: Any, epochs: int, decode_in: str = "thread") -> tuple[float, Any]:
        loader = DecodeLoader(work / path, 256, transform=transform, device=DEV, decode_in=decode_in)
        for _ in loader:  # warm epoch: unit cache, allocator, cudnn
            pass
        sync()
        t0 = time.perf_counter()
        count = 0
        for _ in range(epochs):
            for x, _y in loader:
                count += len(x)
        sync()
        return count / (time.perf_counter() - t0), loader.stats

    out.update(decode_breakdown(work))
    rates: dict[str, list[float]] = {"bare": [], "loader": []}
    for _ in range(args.repeats):  # alternate, median
        rates["bare"].append(bare(2))
        rates["loader"].append(loader_rate("jpeg256", None, 2)[0])
    out["bare_decode_jpeg_batch256"] = rates["bare"]
    out["decode_loader_256px"] = rates["loader"]
    for name in ("jpeg_short256", "jpeg_short128"):  # what bounds ResNet-18 @112 (batch 512)
        out[f"bare_decode_{name}_batch512"] = bare_rate(work / name, 512)
    for where in ("stream",):
        out[f"decode_loader_256px_{where}"] = loader_rate("jpeg256", None, 2, where)[0]
    rrc = RaggedRandomResizedCrop(224, mean=MEAN, std=STD, out_dtype=torch.bfloat16, channels_last=True).to(
        DEV
    )
    out["decode_loader_short256_rrc224"], stats = loader_rate("jpeg_short256", rrc, 2)
    out["decode_loader_stats"] = vars(stats)
    rrc112 = RaggedRandomResizedCrop(
        112, mean=MEAN, std=STD, out_dtype=torch.bfloat16, channels_last=True
    ).to(DEV)
    out["decode_loader_short256_rrc112"] = loader_rate("jpeg_short256", rrc112, 2)[0]
    out["decode_loader_short128_rrc112"] = loader_rate("jpeg_short128", rrc112, 2)[0]
    out["decode_loader_zarr_short256_rrc224"] = loader_rate("zarr_jpeg_short256", rrc, 2)[0]
    bare_med, loader_med = float(np.median(rates["bare"])), float(np.median(rates["loader"]))
    target("jpeg: GPU decode alone (DecodeLoader, 256px, img/s >= 30k)", loader_med, 1.0, 30000)
    target("jpeg: DecodeLoader vs bare batched decode_jpeg (same run)", loader_med, bare_med, 0.9)
    return out


def bare_rate(path: Path, batch: int, passes: int = 2) -> float:
    """Batched decode_jpeg alone on pre-read payloads of ``path`` (img/s)."""
    from torchvision.io import decode_jpeg

    cache = open_cache(path)
    n = len(cache) // batch * batch
    payloads, _ = cache.read_payloads(np.arange(n))
    tensors = [torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in payloads]
    batches = [tensors[a : a + batch] for a in range(0, n, batch)]
    decode_jpeg(batches[0], device=DEV)
    sync()
    t0 = time.perf_counter()
    for _ in range(passes):
        for b in batches:
            decode_jpeg(b, device=DEV)
    sync()
    return passes * n / (time.perf_counter() - t0)


def decode_breakdown(work: Path) -> dict[str, float]:
    """Each step of the GPU path alone, 256-image batches of the shorter-256 cache: read (CRC'd payloads),
    frombuffer, decode_on_device, RRC 224 on the decoded list."""
    from dlstore.read.gpu_decode import as_tensors, decode_on_device

    cache = open_cache(work / "jpeg_short256")
    cache.reader.threads = CORES
    n = len(cache) // 256 * 256
    index = [np.arange(a, a + 256) for a in range(0, n, 256)]  # dataset indices; reads sort by storage

    def rate(fn: Callable[[int], Any], passes: int = 2) -> float:
        fn(0)
        sync()
        t0 = time.perf_counter()
        for _ in range(passes):
            for b in range(len(index)):
                fn(b)
        sync()
        return passes * n / (time.perf_counter() - t0)

    read = [cache.read_payloads(i) for i in index]
    tensors = [as_tensors(p) for p, _ in read]
    dev = torch.device(DEV)
    decoded = [
        decode_on_device(cache, p, s, cache.positions[i], dev, t)[0]
        for (p, s), t, i in zip(read, tensors, index)
    ]
    rrc = RaggedRandomResizedCrop(224, mean=MEAN, std=STD, out_dtype=torch.bfloat16, channels_last=True).to(
        DEV
    )
    return {
        "breakdown_read_payloads": rate(lambda b: cache.read_payloads(index[b])),
        "breakdown_frombuffer": rate(lambda b: as_tensors(read[b][0])),
        "breakdown_decode_on_device": rate(
            lambda b: decode_on_device(
                cache, read[b][0], read[b][1], cache.positions[index[b]], dev, tensors[b]
            )
        ),
        "breakdown_rrc224": rate(lambda b: rrc(decoded[b])),
    }


def _one_core(
    codec: Any, items: list[tuple[bytes, tuple[int, int, int]]], decoder: str, rounds: int = 3
) -> float:
    """The ceiling's one-core rate: the best of ``rounds`` passes after a warm-up (a ceiling is what one
    core can do; a single pass read 1.9k-3.2k img/s for the same decoder in two runs)."""
    os.environ["DLSTORE_JPEG_DECODER"] = decoder
    for p, s in items[:64]:
        codec.decode(p, s)
    best = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        for p, s in items:
            codec.decode(p, s)
        best = max(best, len(items) / (time.perf_counter() - t0))
    return best


def _dataset_one_core(work: Path, n: int, decoder: str, rounds: int = 3) -> float:
    """CachedDataset.__getitems__ (batches of 256, shuffled, one reader thread) in this process: against
    the bare one-core decode of the same payloads, the per-image cost of the dataset path."""
    os.environ["DLSTORE_JPEG_DECODER"] = decoder
    ds = CachedDataset(work / "jpeg256", check_source=False)
    ds.cache.reader.threads = 1
    perm = np.random.default_rng(0).permutation(n)
    batches = [perm[a : a + 256].tolist() for a in range(0, n - 255, 256)]
    ds.__getitems__(batches[0])
    best = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        for b in batches:
            ds.__getitems__(b)
        best = max(best, len(batches) * 256 / (time.perf_counter() - t0))
    return best


def _threads_rate(cache: Any, sel: np.ndarray, threads: int) -> float:
    """reader.read (batches of 256 decoded into one array, threads over slices of the batch)."""
    cache.reader.threads = threads
    cache.read(sel[:256])
    t0 = time.perf_counter()
    for a in range(0, len(sel) - 255, 256):
        cache.read(sel[a : a + 256])
    return (len(sel) // 256 * 256) / (time.perf_counter() - t0)


def _workers_rate(work: Path, batches: int) -> dict[str, float]:
    ds = CachedDataset(work / "jpeg256", check_source=False)
    dl = torch.utils.data.DataLoader(
        ds,
        batch_size=256,
        shuffle=True,
        num_workers=CORES,
        persistent_workers=True,
        prefetch_factor=4,
        drop_last=True,
    )
    it = iter(dl)

    def nxt() -> Any:
        nonlocal it
        try:
            return next(it)
        except StopIteration:
            it = iter(dl)
            return next(it)

    for _ in range(CORES):  # every worker started and warm
        nxt()
    pids = [w.pid for w in it._workers]  # type: ignore[attr-defined]
    main0, workers0, t0 = harness.cpu_seconds([os.getpid()]), harness.cpu_seconds(pids), time.perf_counter()
    count = 0
    for _ in range(batches):
        x, _y = nxt()
        count += len(x)
    seconds = time.perf_counter() - t0
    busy = {
        "img_s": count / seconds,
        "main_cpu_share": (harness.cpu_seconds([os.getpid()]) - main0) / seconds,
        "workers_cpu_share_each": (harness.cpu_seconds(pids) - workers0) / seconds / len(pids),
    }
    it._shutdown_workers()  # type: ignore[attr-defined]  # no prefetching worker runs into the next measurement
    del it
    return busy


def section_cpu_decode(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Pillow vs simplejpeg (same libjpeg-turbo; pixels compared), one core, threads in one process, and
    CachedDataset in CORES DataLoader worker processes. The target's base is cores x the one-core rate of
    the decoder the path uses (so a faster decoder does not flatter its own scaling)."""
    cache = open_cache(work / "jpeg256")
    codec = get_codec("jpeg")
    sel = np.arange(min(2048, len(cache)))
    payloads, shapes = cache.read_payloads(sel)
    items = [(bytes(p), tuple(int(v) for v in s)) for p, s in zip(payloads, shapes)]
    out: dict[str, Any] = {}
    wanted = args.cpu_decode_with.split(",")
    decoders = ["pillow"] if "pillow" in wanted else []
    try:
        import simplejpeg

        if "simplejpeg" in wanted:
            decoders.append("simplejpeg")
        out["simplejpeg_version"] = simplejpeg.__version__
    except ImportError as e:
        out["simplejpeg_error"] = str(e)
    try:
        import turbojpeg  # noqa: F401  PyTurboJPEG needs a system libturbojpeg

        out["pyturbojpeg"] = "importable"
    except Exception as e:
        out["pyturbojpeg"] = f"{type(e).__name__}: {e}"
    if "simplejpeg" in decoders and "pillow" in decoders:
        diffs = []
        for p, s in items[:256]:
            os.environ["DLSTORE_JPEG_DECODER"] = "pillow"
            a = codec.decode(p, s).astype(np.int16)
            os.environ["DLSTORE_JPEG_DECODER"] = "simplejpeg"
            diffs.append(float(np.abs(codec.decode(p, s).astype(np.int16) - a).mean()))
        out["simplejpeg_vs_pillow_mean_abs_max"] = max(diffs)
    for dec in decoders:
        r: dict[str, Any] = {"one_core": _one_core(codec, items[:1024], dec)}
        r["dataset_one_core"] = _dataset_one_core(work, min(1024, len(items)), dec)
        for t in (4, 8, CORES):
            r[f"threads_{t}"] = _threads_rate(cache, sel, t)
        # as many images per process as the DataLoader measurement decodes per worker (round D: 300
        # each, ~0.15 s, against 30 batches of 256 over 16 workers: both windows short)
        per_proc = max(300, args.cpu_batches * 256 // CORES)
        alone = harness.all_cores_rate(lambda i: codec.decode(*items[i]), len(items), CORES, per_proc)
        r[f"decode_alone_{CORES}_processes"] = alone["img_s"]
        busy = _workers_rate(work, args.cpu_batches)
        r[f"dataloader_{CORES}_workers"] = busy.pop("img_s")
        r[f"dataloader_{CORES}_workers_cpu"] = busy
        out[dec] = r
        log(f"cpu decode {dec}: {r}")
    os.environ.pop("DLSTORE_JPEG_DECODER", None)
    best = decoders[-1]
    r = out[best]
    target(
        f"jpeg: CPU decode ({best}), CachedDataset + {CORES} DataLoader workers vs cores x one-core {best}",
        r[f"dataloader_{CORES}_workers"],
        CORES * r["one_core"],
        0.85,
        note=f"one core {r['one_core']:,.0f} img/s; {CORES} threads in one process {r[f'threads_{CORES}']:,.0f}"
        + (
            f"; Pillow one core {out['pillow']['one_core']:,.0f}, {CORES} workers "
            f"{out['pillow'][f'dataloader_{CORES}_workers']:,.0f}"
            if "pillow" in out
            else ""
        ),
    )
    target(
        f"jpeg: CPU decode ({best}), CachedDataset + {CORES} DataLoader workers vs {best} decode alone in "
        f"{CORES} processes",
        r[f"dataloader_{CORES}_workers"],
        r[f"decode_alone_{CORES}_processes"],
        0.85,
        note="the ceiling the cores reach together: decode alone (no loader) in as many processes",
    )
    target(
        f"jpeg: CPU decode ({best}), CachedDataset.__getitems__ one core vs bare one-core {best} (diagnostic)",
        r["dataset_one_core"],
        r["one_core"],
        0.85,
        note="the dataset path's per-image cost over the decode itself, same payloads, one process",
    )
    target(
        f"jpeg: CPU decode ({best}), {CORES} threads in one process vs cores x one-core {best}",
        r[f"threads_{CORES}"],
        CORES * r["one_core"],
        0.85,
    )
    return out


# --- training -----------------------------------------------------------------------------------------


def resnet_step(name: str, classes: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
    import torchvision

    model = (
        getattr(torchvision.models, name)(num_classes=classes).to(DEV).to(memory_format=torch.channels_last)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast(DEV, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def training_setup(
    model: str, res: int, batch: int
) -> tuple[Callable[[torch.Tensor, torch.Tensor], None], Callable[[], Any], RaggedRandomResizedCrop]:
    """The model's bf16 step, a synthetic-data source (one device batch, again and again: the ceiling)
    and the GPU RandomResizedCrop to ``res`` (normalised, bf16, channels-last) the loaders use."""
    torch.backends.cudnn.benchmark = True
    step = resnet_step(model, 10)
    x = (
        torch.randn(batch, 3, res, res, device=DEV)
        .to(torch.bfloat16)
        .contiguous(memory_format=torch.channels_last)
    )
    y = torch.randint(0, 10, (batch,), device=DEV)

    def synthetic() -> Any:
        while True:
            yield x, y

    rrc = RaggedRandomResizedCrop(res, mean=MEAN, std=STD, out_dtype=torch.bfloat16, channels_last=True)
    return step, synthetic, rrc.to(DEV)


def timed_steps(
    batches: Callable[[], Any], step: Callable[..., None], warmup: int, steps: int, batch: int
) -> float:
    it = batches()

    def nxt() -> Any:
        nonlocal it
        try:
            return next(it)
        except StopIteration:
            it = batches()
            return next(it)

    for _ in range(warmup):
        step(*nxt())
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step(*nxt())
    sync()
    return steps * batch / (time.perf_counter() - t0)


def predecoded(path: Path, batch: int) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
    """Diagnostic: every batch already decoded on the GPU, so a run with it costs only the crop."""
    loader = DecodeLoader(path, batch, transform=lambda imgs: imgs, device=DEV)  # type: ignore[arg-type,return-value]
    return [(imgs, labels) for imgs, labels in loader]


class _ToGpu:
    """An ImageFolder DataLoader's uint8 batches to the GPU, normalised there."""

    def __init__(self, dl: Any) -> None:
        self.dl = dl

    def __iter__(self) -> Any:
        from dlstore.gpu import normalize

        for x, y in self.dl:
            x = normalize(x.to(DEV, non_blocking=True), MEAN, STD, torch.bfloat16)
            yield x.contiguous(memory_format=torch.channels_last), y.to(DEV, non_blocking=True)


def imagefolder_loader(work: Path, res: int, batch: int) -> Any:
    from torchvision import datasets
    from torchvision import transforms as T

    tf = T.Compose([T.RandomResizedCrop(res), T.RandomHorizontalFlip(), T.PILToTensor()])
    ds = datasets.ImageFolder(str(work / "photos"), transform=tf)
    return torch.utils.data.DataLoader(
        ds,
        batch_size=batch,
        shuffle=True,
        num_workers=CORES,
        pin_memory=True,
        drop_last=True,
        persistent_workers=True,
        prefetch_factor=4,
    )


def section_train(args: argparse.Namespace, work: Path, model: str, res: int, batch: int) -> dict[str, Any]:
    step, synthetic, rrc = training_setup(model, res, batch)
    torch_rrc = RaggedRandomResizedCrop(
        res, mean=MEAN, std=STD, out_dtype=torch.bfloat16, channels_last=True
    ).to(DEV)
    torch_rrc.fused = False  # the PyTorch gather instead of the fused Triton kernel
    storage = "jpeg_short128" if res <= 128 else "jpeg_short256"
    plan: list[tuple[str, str, Any, int]] = (
        [
            ("jpeg_short256", "thread", rrc, 0),
            ("jpeg_short128", "thread", rrc, 0),
            ("jpeg_short128", "stream", rrc, 0),
        ]
        if res <= 128
        else [
            ("jpeg_short256", "thread", rrc, 0),
            ("jpeg_short256", "stream", rrc, 0),
            ("jpeg_short256", "thread", torch_rrc, 0),
        ]
    )
    if args.lean:  # round D: the default loader only, beside the split with CPU decoders
        plan = [(storage, "thread", rrc, 0)]
    if decoder_counts(args):
        plan.append((storage, "thread", rrc, decoder_counts(args)[0]))
    jpeg = {
        f"{name}_{where}{'_torchcrop' if crop is torch_rrc else ''}{f'_cpu{cpus}' if cpus else ''}": DecodeLoader(
            work / name, batch, transform=crop, device=DEV, decode_in=where, cpu_decoders=cpus
        )
        for name, where, crop, cpus in plan
    }
    aug = GpuAugment(res, mean=MEAN, std=STD, out_dtype=torch.bfloat16, channels_last=True).to(DEV)
    pinned = PinnedLoader(open_cache(work / "raw256", in_memory=True), batch, device=DEV, order="random")

    def augmented() -> Any:
        return ((aug(a), b) for a, b in pinned)

    folder = None if args.lean else _ToGpu(imagefolder_loader(work, res, batch))
    decoded = [] if args.lean else predecoded(work / "jpeg_short256", batch)

    def crop_only(crop: Any) -> Any:
        for imgs, labels in decoded:
            yield crop(imgs), labels

    def switch_1ms() -> float:
        """Diagnostic: the GIL handed over every 1 ms instead of 5 (threads waiting on the GIL)."""
        old = sys.getswitchinterval()
        sys.setswitchinterval(0.001)
        try:
            ld = jpeg["jpeg_short128_thread" if res <= 128 else "jpeg_short256_thread"]
            return timed_steps(lambda: iter(ld), step, args.warmup, args.steps, batch)
        finally:
            sys.setswitchinterval(old)

    cfgs: dict[str, Callable[[], float]] = {
        "synthetic": lambda: timed_steps(synthetic, step, args.warmup, args.steps, batch),
        **{
            f"{name}_gpu_decode_0_workers": (
                lambda ld=ld: timed_steps(lambda: iter(ld), step, args.warmup, args.steps, batch)
            )
            for name, ld in jpeg.items()
        },
        "raw_ram_pinned_0_workers": lambda: timed_steps(augmented, step, args.warmup, args.steps, batch),
    }
    if not args.lean:
        # diagnostic: batches decoded before the run, so only the crop runs with the model
        cfgs["jpeg_short256_predecoded_crop_only"] = lambda: timed_steps(
            lambda: crop_only(rrc), step, args.warmup, args.steps, batch
        )
        cfgs["jpeg_thread_switch_1ms"] = switch_1ms
        cfgs[f"imagefolder_{CORES}_workers"] = lambda: timed_steps(
            lambda: iter(folder), step, args.warmup, args.steps, batch
        )
    if res > 128 and not args.lean:
        cfgs["jpeg_short256_predecoded_torchcrop_only"] = lambda: timed_steps(
            lambda: crop_only(torch_rrc), step, args.warmup, args.steps, batch
        )
    out: dict[str, list[float]] = {k: [] for k in cfgs}
    names = list(cfgs)
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            out[name].append(cfgs[name]())
            log(f"{model}@{res} {name}: {out[name][-1]:,.0f} img/s")
    med = {k: float(np.median(v)) for k, v in out.items()}
    ceiling = med["synthetic"]
    side = (
        f"raw ram {med['raw_ram_pinned_0_workers']:,.0f}, ImageFolder x{CORES} "
        f"{med.get(f'imagefolder_{CORES}_workers', float('nan')):,.0f}, pre-decoded + crop only "
        f"{med.get('jpeg_short256_predecoded_crop_only', float('nan')):,.0f} img/s"
    )
    label = "ResNet-50" if model == "resnet50" else "ResNet-18"
    goal = 0.97 if model == "resnet50" else 0.70
    for key in sorted(k for k in med if k.endswith("_gpu_decode_0_workers")):
        storage = "shorter-128" if "short128" in key else "shorter-256"
        storage += ", PyTorch crop" if "torchcrop" in key else ""
        where = {
            "thread": "decode in a side thread",
            "stream": "decode on a side stream",
        }[key.split("_")[2]]
        how = "GPU decode+RRC, 0 workers, "
        if "_cpu" in key:  # the batch split between nvJPEG and CPU decode processes
            how = f"nvJPEG + {decoder_counts(args)[0]} CPU decoders, auto split, RRC, "
        target(
            f"jpeg: {label} bf16 @{res} bs{batch} from JPEG cache {storage} ({how}{where}) vs synthetic",
            med[key],
            ceiling,
            goal,
            note=side,
        )
    from dlstore.gpu import fused_crop

    for ld in jpeg.values():
        ld.close()
    return {
        "runs": out,
        "median": med,
        "cpu_share": {k: ld.stats.cpu_share for k, ld in jpeg.items() if ld.cpu_decoders},
        "fused_crop_available": fused_crop.available(torch.device(DEV)),
        "fused_crop_failures": list(fused_crop._BROKEN),
    }


# --- issue 10 again: nvJPEG + CPU decoder processes, and DecodeLoader vs bare decode step by step ----------


def loader_alone(loader: Any, epochs: int = 2) -> tuple[float, float]:
    """img/s of iterating the loader (no model) after a warm epoch, and the mean seconds from iter() to
    the first batch of an epoch."""
    for _ in loader:
        pass
    sync()
    t0, count, first = time.perf_counter(), 0, 0.0
    for _ in range(epochs):
        e0 = time.perf_counter()
        for i, (x, _y) in enumerate(loader):
            if i == 0:
                sync()
                first += time.perf_counter() - e0
            count += len(x)
    sync()
    return count / (time.perf_counter() - t0), first / epochs


def decoder_counts(args: argparse.Namespace) -> list[int]:
    """--cpu-decoders as a list of process counts (empty: none)."""
    return [int(v) for v in str(args.cpu_decoders).split(",") if v and int(v) > 0]


def section_hybrid(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """ResNet-18 bf16 @112 (batch 512) from the shorter-128 JPEG cache: nvJPEG alone vs each batch split
    between nvJPEG and ``--cpu-decoders`` CPU worker processes (the automatic split, fixed shares, all on
    the CPU), with and without the model."""
    batch, res, path = 512 // args.batch_div, 112, work / "jpeg_short128"
    step, synthetic, rrc = training_setup("resnet18", res, batch)
    counts = decoder_counts(args)
    n = counts[0]  # the fixed shares and the auto target row use the first count
    shares: list[float | None] = [None, *(float(v) for v in args.shares.split(",") if v), 1.0]
    plan: list[tuple[Any, ...]] = [(n, share) for share in shares]
    plan += [(m, share) for m in counts[1:] for share in (None, 1.0)]
    loaders: dict[str, DecodeLoader] = {"nvjpeg_only": DecodeLoader(path, batch, transform=rrc, device=DEV)}
    if args.hybrid_gated:  # side by side: the same splits with the read-ahead gated to the decode calls
        plan += [(n, None, "gated"), (n, 1.0, "gated")]
    for m, share, *kind in plan:
        name = f"cpu{m}_{'auto' if share is None else share}" + "".join(f"_{k}" for k in kind)
        cls = GatedLoader if kind else DecodeLoader
        loaders[name] = cls(path, batch, transform=rrc, device=DEV, cpu_decoders=m, cpu_share=share)
        if DEV == "cpu":  # dry run: exercise the split with torchvision's CPU decode as the "GPU" side
            loaders[name].gpu = True
    if args.hybrid_device_boxes:  # side by side: the crop drawing its boxes on the device (before 087ed1d)
        dev_rrc = RaggedRandomResizedCrop(
            res, mean=MEAN, std=STD, out_dtype=torch.bfloat16, channels_last=True
        ).to(DEV)
        dev_rrc.samples_on_host = False
        name = f"cpu{n}_1.0_devboxes"
        loaders[name] = DecodeLoader(
            path, batch, transform=dev_rrc, device=DEV, cpu_decoders=n, cpu_share=1.0
        )
        if DEV == "cpu":
            loaders[name].gpu = True
    if args.hybrid_loaders != "all":  # e.g. one configuration under a profiler
        keep = set(args.hybrid_loaders.split(","))
        loaders = {k: v for k, v in loaders.items() if k in keep}
    out: dict[str, Any] = {"cpu_decoders": counts, "alone": {}, "first_batch_s": {}}
    for name, ld in loaders.items():
        rate, first = loader_alone(ld)
        out["alone"][name], out["first_batch_s"][name] = rate, first
        log(
            f"hybrid alone {name}: {rate:,.0f} img/s (share now {ld.stats.cpu_share:.2f}, first batch {first * 1e3:.0f} ms)"
        )
    cfgs: dict[str, Callable[[], float]] = {
        "synthetic": lambda: timed_steps(synthetic, step, args.warmup, args.steps, batch),
        **{
            name: (lambda ld=ld: timed_steps(lambda: iter(ld), step, args.warmup, args.steps, batch))
            for name, ld in loaders.items()
        },
    }
    if args.hybrid_diagnostics:  # what slows the step beside the loader: busy CPU decoders, or the crop
        decoded = predecoded(path, batch)
        cfgs["synthetic_cpu_busy"] = lambda: with_busy_decoders(
            path, n, batch, lambda: timed_steps(synthetic, step, args.warmup, args.steps, batch)
        )
        cfgs["crop_only"] = lambda: timed_steps(
            lambda: ((rrc(imgs), y) for imgs, y in decoded), step, args.warmup, args.steps, batch
        )
        if args.hybrid_device_boxes:
            cfgs["crop_only_devboxes"] = lambda: timed_steps(
                lambda: ((dev_rrc(imgs), y) for imgs, y in decoded), step, args.warmup, args.steps, batch
            )
        one = _payload_items(path, 512)
        out["one_core_simplejpeg_img_s"] = _one_core(get_codec("jpeg", 90), one, "simplejpeg")
    runs: dict[str, list[float]] = {k: [] for k in cfgs}
    names = list(cfgs)
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            runs[name].append(cfgs[name]())
            log(f"hybrid resnet18@112 {name}: {runs[name][-1]:,.0f} img/s")
    med = {k: float(np.median(v)) for k, v in runs.items()}
    out.update(
        runs=runs,
        median=med,
        auto_share={k: ld.stats.cpu_share for k, ld in loaders.items()},
        stats={k: vars(ld.stats) for k, ld in loaders.items()},
        cpu_worker_us_per_image={
            k: 1e6 * ld.stats.cpu_busy_seconds / ld.stats.cpu_images
            for k, ld in loaders.items()
            if ld.stats.cpu_images
        },
        pinned={k: bool(ld.cpu and ld.cpu.pinned) for k, ld in loaders.items()},
    )
    for ld in loaders.values():
        ld.close()
    ceiling = med["synthetic"]
    auto = f"cpu{n}_auto"
    if not {auto, "nvjpeg_only"} <= set(med):  # --hybrid-loaders left them out: no target rows
        return out
    best = max((k for k in med if k.startswith("cpu")), key=lambda k: med[k])
    note = f"nvJPEG alone {med['nvjpeg_only']:,.0f} img/s; auto share ended at {out['auto_share'][auto]:.2f}"
    for k in (k for k in med if k.endswith("_gated")):
        note += f"; {k} {med[k] / ceiling:.3f} vs ungated {med[k[: -len('_gated')]] / ceiling:.3f}"
    target(
        f"jpeg: ResNet-18 bf16 @112 bs512 from JPEG cache shorter-128, nvJPEG + {n} CPU decoders (auto split) vs synthetic",
        med[auto],
        ceiling,
        0.70,
        note=note,
    )
    target(
        f"jpeg: ResNet-18 bf16 @112 bs512 from JPEG cache shorter-128, best split ({best}) vs synthetic",
        med[best],
        ceiling,
        0.70,
        note=note,
    )
    target(
        "jpeg: ResNet-18 bf16 @112 bs512 from JPEG cache shorter-128, nvJPEG only (side thread) vs synthetic",
        med["nvjpeg_only"],
        ceiling,
        0.70,
    )
    return out


def _payload_items(path: Path, n: int) -> list[tuple[bytes, tuple[int, int, int]]]:
    """The first ``n`` payloads of a JPEG cache with their (H, W, C) shapes."""
    cache = open_cache(path)
    payloads, shapes = cache.read_payloads(np.arange(min(n, len(cache))))
    return [(bytes(p), tuple(int(v) for v in sh)) for p, sh in zip(payloads, shapes.tolist())]  # type: ignore[misc]


def with_busy_decoders(path: Path, processes: int, batch: int, fn: Callable[[], float]) -> float:
    """``fn()`` while ``processes`` CPU decode workers decode one batch of the cache over and over (the
    CPU load of DecodeLoader's CPU share, without its GPU work): how much that load alone slows the step."""
    import threading

    from dlstore.read.cpu_decode import CpuDecoders

    cache = open_cache(path)
    extents = cache.payload_extents(np.arange(min(batch, len(cache))))
    count = len(extents.buffer)
    pixels = int(np.prod(extents.shapes, axis=1).sum())
    slot = max(pixels * 4 // 3, int(CpuDecoders.input_bytes(extents).sum()) * 4) + (1 << 16)
    dec = CpuDecoders("jpeg", 90, processes, slots=2, slot_bytes=slot)
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            s = dec.acquire()
            try:
                dec.submit(s, extents, count).wait()
            finally:
                dec.release(s)

    th = threading.Thread(target=load, daemon=True)
    th.start()
    try:
        time.sleep(0.2)
        return fn()
    finally:
        stop.set()
        th.join(10)
        dec.close()


class UngatedLoader(DecodeLoader):
    """Round D's DecodeLoader: the read-ahead thread reads whenever its queue has room (no token per
    decode call), for the side-by-side comparison in the ladder."""

    def _read_gate(self) -> Any:
        return None


class GatedLoader(DecodeLoader):
    """The read-ahead gated to the decode calls even with CPU decoders (DecodeLoader gates only
    without them), for the side-by-side comparison in the hybrid section."""

    def _read_gate(self) -> Any:
        import threading

        return threading.Semaphore(self.read_ahead)


def busy_python(seconds: float) -> None:
    """Hold the GIL in pure Python for about ``seconds`` (a training loop's launch work, say)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def timed_loader(loader: DecodeLoader, epochs: int, busy: float = 0.0) -> dict[str, float]:
    """img/s of ``epochs`` epochs after a warm one, the first-batch latency, and per batch (ms): wall
    time, time inside the device decode call, reading, the decode thread waiting for a read. ``busy``:
    the consumer holds the GIL that long per batch."""
    for _ in loader:
        pass
    sync()
    before = dict(vars(loader.stats))
    t0, count, first = time.perf_counter(), 0, 0.0
    for _ in range(epochs):
        e0 = time.perf_counter()
        for i, (x, _y) in enumerate(loader):
            if i == 0:
                first += time.perf_counter() - e0
            if busy:
                busy_python(busy)
            count += len(x)
    sync()
    wall = time.perf_counter() - t0
    st = {k: v - before[k] for k, v in vars(loader.stats).items() if isinstance(v, int | float)}
    n = max(1, st["batches"])
    return {
        "img_s": count / wall,
        "first_batch_ms": 1e3 * first / epochs,
        "wall_ms": 1e3 * wall / n,
        "decode_call_ms": 1e3 * st["decode_seconds"] / n,
        "read_ms": 1e3 * st["read_seconds"] / n,
        "read_wait_ms": 1e3 * st["read_wait_seconds"] / n,
        "cpu_worker_us_per_image": 1e6 * st["cpu_busy_seconds"] / max(1, st["cpu_images"]),
        "sync_ms": 1e3 * st["sync_seconds"] / n,
        "share_wait_ms": 1e3 * st["share_wait_seconds"] / n,
        "transform_ms": 1e3 * st["transform_seconds"] / n,
    }


def section_ladder(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """DecodeLoader vs bare batched decode_jpeg (256² cache, batch 256), repeated with the order rotated:
    (a) bare on copies, sequential batches (the target's base); (d) the loader's batches (chunk-aware
    order, payload views, read before timing) on a side stream with the loader's per-batch work; (f) the
    loader (decode in a second thread, reads gated to the decode calls); (f0) round D's loader (reads
    whenever the queue has room); (e) f decoding in the caller's thread; *_si: with the interpreter's
    switch interval 0.5 ms instead of 5 ms (if the gap is GIL hand-overs, it shrinks); *_busy: the
    consumer holds the GIL 2 ms per batch (a training loop's Python). Loader rows record where the
    time went per batch (decode call, read, waiting for reads)."""
    from torchvision.io import decode_jpeg

    from dlstore.read.gpu_decode import as_tensors
    from dlstore.read.loaders import make_sampler, storage_sorted

    cache = open_cache(work / "jpeg256")
    cache.reader.threads = CORES
    n, bs = len(cache) // 256 * 256, 256
    payloads, _ = cache.read_payloads(np.arange(n))
    copies = [torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in payloads]
    seq = [copies[a : a + bs] for a in range(0, n, bs)]
    sampler = make_sampler(cache, "auto", 0)
    order = list(torch.utils.data.BatchSampler(sampler, bs, True))
    views, labels = [], []
    for b in order:
        index = storage_sorted(cache, b)
        p, _s = cache.read_payloads(index)
        views.append(as_tensors(p))
        labels.append(cache.labels[index])
    dev = torch.device(DEV)
    side = torch.cuda.Stream(dev) if DEV == "cuda" else None
    epochs = 2

    def timed(fn: Callable[[int], Any], count: int) -> dict[str, float]:
        fn(0)
        sync()
        t0 = time.perf_counter()
        for _ in range(epochs):
            for i in range(count):
                fn(i)
        sync()
        wall = time.perf_counter() - t0
        return {"img_s": epochs * count * bs / wall, "wall_ms": 1e3 * wall / (epochs * count)}

    def loader_work(i: int) -> Any:
        if side is None:
            return torch.stack(decode_jpeg(views[i], device=DEV))
        with torch.cuda.stream(side):
            side.synchronize()
            batch = torch.stack(decode_jpeg(views[i], device=DEV))
            lab = torch.from_numpy(labels[i]).to(dev, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(side)
        torch.cuda.current_stream(dev).wait_event(ev)
        return batch, lab

    n_cpu = decoder_counts(args)[:1]
    loaders = {
        "f": DecodeLoader(cache, bs, device=DEV),
        "f0": UngatedLoader(cache, bs, device=DEV),
        "e": DecodeLoader(cache, bs, device=DEV, decode_in="stream"),
        **{
            f"h{m}_{s}": DecodeLoader(cache, bs, device=DEV, cpu_decoders=m, cpu_share=v)
            for m in n_cpu
            for s, v in (("auto", None), ("1.0", 1.0))
        },
    }
    if DEV == "cpu":  # dry run: torchvision's CPU decode stands in for nvJPEG
        for ld in loaders.values():
            ld.gpu = True

    def with_switch(fn: Callable[[], dict[str, float]]) -> dict[str, float]:
        old = sys.getswitchinterval()
        sys.setswitchinterval(0.0005)
        try:
            return fn()
        finally:
            sys.setswitchinterval(old)

    steps: dict[str, Callable[[], dict[str, float]]] = {
        "a_bare_copies_sequential": lambda: timed(lambda i: decode_jpeg(seq[i], device=DEV), len(seq)),
        "d_bare_plus_loader_per_batch_work": lambda: timed(loader_work, len(views)),
        "f_loader_second_thread": lambda: timed_loader(loaders["f"], epochs),
        "f0_round_d_loader_ungated": lambda: timed_loader(loaders["f0"], epochs),
        "e_loader_caller_thread": lambda: timed_loader(loaders["e"], epochs),
        "f0_si": lambda: with_switch(lambda: timed_loader(loaders["f0"], epochs)),
        "f_busy": lambda: timed_loader(loaders["f"], epochs, busy=0.002),
        "f_busy_si": lambda: with_switch(lambda: timed_loader(loaders["f"], epochs, busy=0.002)),
        **{
            f"h_cpu{k[1:]}": (lambda k=k: timed_loader(loaders[k], epochs))
            for k in loaders
            if k.startswith("h")
        },
    }
    if args.ladder != "all":  # fewer variants, more repeats (the bare rate itself moves ±20% between repeats)
        keep = {"a_bare_copies_sequential", "f_loader_second_thread", *args.ladder.split(",")}
        steps = {k: v for k, v in steps.items() if k in keep}
    out: dict[str, list[dict[str, float]]] = {k: [] for k in steps}
    names = list(steps)
    for r in range(args.repeats):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            out[k].append(steps[k]())
            row = out[k][-1]
            log(f"ladder {k}: " + ", ".join(f"{m} {v:,.2f}" for m, v in row.items()))
    med = {k: {m: float(np.median([row[m] for row in rows])) for m in rows[0]} for k, rows in out.items()}

    def paired(k: str) -> list[float]:
        return [r["img_s"] / a["img_s"] for r, a in zip(out[k], out["a_bare_copies_sequential"])]

    bare, f = (med[k]["img_s"] for k in ("a_bare_copies_sequential", "f_loader_second_thread"))
    target(
        "jpeg: DecodeLoader (second thread) vs bare batched decode_jpeg, ladder run",
        f,
        bare,
        0.9,
        note=f"paired ratios (same repeat) median {np.median(paired('f_loader_second_thread')):.3f}; "
        + ", ".join(f"{k} {v['img_s']:,.0f}" for k, v in med.items()),
    )
    target("jpeg: DecodeLoader nvJPEG only, decode alone at 256 px (img/s)", f, 30000, 30000)
    for k in (k for k in med if k.startswith("h_cpu")):
        m, share = k[5:].split("_")
        target(
            f"jpeg: DecodeLoader nvJPEG + {m} CPU decoders ({share} share), decode alone at 256 px (img/s)",
            med[k]["img_s"],
            30000,
            30000,
            note=f"vs bare batched decode_jpeg in the same repeats: median paired ratio {np.median(paired(k)):.3f}",
        )
    print(
        f"{'ladder step (median of ' + str(args.repeats) + ')':38} "
        + " ".join(f"{m:>14}" for m in med[names[-1]])
    )
    for k, row in med.items():
        print(f"{k:38} " + " ".join(f"{row.get(m, float('nan')):14.2f}" for m in med[names[-1]]))
    for ld in loaders.values():
        ld.close()
    pairs = {k: paired(k) for k in out if k != "a_bare_copies_sequential"}
    return {"runs": out, "median": med, "paired_over_bare": pairs, "images": n, "batch": bs, "epochs": epochs}


# --- issue 27: every decode lane at once (CPU processes, NVJPG via nvImageCodec, nvJPEG) -----------------
# python benchmarks/jpeg_cache.py --out OUT --caches jpeg_short128,jpeg_short256 --cpu-decoders 12 \
#   --sections data,lanes_pixels,lanes_bare,lanes_train,lanes_loader


def _batches(path: Path, batch: int) -> tuple[list[list[memoryview]], list[list[torch.Tensor]]]:
    cache = open_cache(path)
    n = len(cache) // batch * batch
    payloads, _ = cache.read_payloads(np.arange(n))
    copies = [memoryview(bytes(p)) for p in payloads]
    tensors = [torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in copies]
    return (
        [copies[a : a + batch] for a in range(0, n, batch)],
        [tensors[a : a + batch] for a in range(0, n, batch)],
    )


def _rate(fn: Any, batches: int, size: int, seconds: float) -> float:
    fn(0)
    sync()
    t0, done = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        fn(done % batches)
        done += 1
    sync()
    return done * size / (time.perf_counter() - t0)


def _lanes_bare(args: argparse.Namespace, work: Path, hw: HardwareJpeg | None) -> dict[str, Any]:
    """Each device lane bare: nvJPEG (torchvision's batched decode_jpeg), the hardware engines, both."""
    out: dict[str, Any] = {}
    for px in (128, 256):
        out[f"{px}px"] = r = _bare_lanes(args, work / f"jpeg_short{px}", hw)
        log(f"lanes bare {px}px: " + ", ".join(f"{k} {v:,.0f}" for k, v in r.items()))
    if hw is not None:  # nvImageCodec's parsing threads for the engines (dlstore's default: CPU_THREADS)
        views, _ = _batches(work / "jpeg_short128", 256)
        sweep = {}
        for threads in (1, 2, 4, 8, 16):
            lane = HardwareJpeg.open(torch.device(DEV), cpu_threads=threads)
            if lane is not None:
                sweep[threads] = _rate(
                    lambda i, lane=lane: lane.decode(views[i]), len(views), 256, args.lanes_seconds
                )
        out["hw_cpu_threads_128px"] = sweep
        log(f"hw lane alone at 128px by nvImageCodec CPU threads: {sweep}")
    return out


def _bare_lanes(args: argparse.Namespace, path: Path, hw: HardwareJpeg | None) -> dict[str, float]:
    from torchvision.io import decode_jpeg

    views, tensors = _batches(path, 256)
    nb = len(views)
    fns = {"nvjpeg": lambda i: decode_jpeg(tensors[i], device=DEV)}
    if hw is not None:
        fns["hw"] = lambda i: hw.decode(views[i])
    r = {name: _rate(fn, nb, 256, args.lanes_seconds) for name, fn in fns.items()}
    if hw is None:
        return r
    counts = [0, 0]
    stop = time.perf_counter() + args.lanes_seconds

    def run(k: int, fn: Any) -> None:
        while time.perf_counter() < stop:
            fn(counts[k] % nb)
            counts[k] += 1

    threads = [threading.Thread(target=run, args=(k, fn)) for k, fn in enumerate(fns.values())]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sync()
    r["hw+nvjpeg"] = (counts[0] + counts[1]) * 256 / (time.perf_counter() - t0)
    return r


def _loader(
    path: Path, batch: int, rrc: Any, lanes: list[str], cpu: int, split: dict | None = None, variant: str = ""
) -> DecodeLoader:
    """``variant`` ``_processN``: decoded in N decode processes (``decode_in="process"``); others see
    ``_variant``."""
    processes = int(variant[len("_process") :] or 1) if variant.startswith("_process") else 0
    ld = DecodeLoader(
        path,
        batch,
        transform=rrc,
        device=DEV,
        cpu_decoders=cpu if "cpu" in lanes else 0,
        lanes=lanes,
        split=split,
        decode_in="process" if processes else "thread",
        decode_processes=max(1, processes),
    )
    return _variant(ld, variant)


def _lane_sets(hw: bool) -> dict[str, list[str]]:
    sets = {"nvjpeg": ["nvjpeg"], "cpu+nvjpeg": ["cpu", "nvjpeg"]}
    if hw:
        sets |= {"hw": ["hw"], "hw+nvjpeg": ["hw", "nvjpeg"], "cpu+hw+nvjpeg": ["cpu", "hw", "nvjpeg"]}
    return sets


def _lanes_loader(args: argparse.Namespace, work: Path, hw: bool) -> dict[str, Any]:
    """DecodeLoader alone per set of lanes (measured split), and nvJPEG-only vs a bare decode loop."""
    out: dict[str, Any] = {}
    sizes = [int(v) for v in args.lanes_sizes.split(",")]
    for px, res, batch in [g for g in ((128, 112, 512), (256, 224, 256)) if g[0] in sizes]:
        batch //= args.batch_div
        path = work / f"jpeg_short{px}"
        from dlstore.gpu import RaggedRandomResizedCrop

        rrc = RaggedRandomResizedCrop(
            res, mean=MEAN, std=STD, out_dtype=torch.bfloat16, channels_last=True
        ).to(DEV)
        r: dict[str, Any] = {}
        for name, lanes in _lane_sets(hw).items():
            if args.lanes_sets != "all" and name not in args.lanes_sets.split(","):
                continue
            ld = _loader(path, batch, rrc, lanes, decoder_counts(args)[0])
            try:
                rate, _first = loader_alone(ld, epochs=args.lanes_epochs)
                r[name] = {"img_s": rate, "shares": ld.split.shares(), "rerouted": ld.stats.rerouted}
            finally:
                ld.close()
            log(f"loader alone {px}px {name}: {rate:,.0f} img/s, shares {ld.split.shares()}")
        r["nvjpeg_vs_bare"] = nvjpeg_vs_bare(args, path, batch, rrc)
        log(f"loader {px}px nvJPEG vs bare: {r['nvjpeg_vs_bare']['over_bare']}")
        out[f"{px}px"] = r
    return out


def _as_list(images: list[torch.Tensor]) -> list[torch.Tensor]:
    return images


def bare_crop_rate(path: Path, batch: int, crop: Any, passes: int = 2) -> float:
    """Batched decode_jpeg + the crop, one loop in this thread, on pre-read payloads (img/s): the bare
    reference for the loader with its crop."""
    from torchvision.io import decode_jpeg

    cache = open_cache(path)
    n = len(cache) // batch * batch
    payloads, _ = cache.read_payloads(np.arange(n))
    tensors = [torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in payloads]
    batches = [tensors[a : a + batch] for a in range(0, n, batch)]
    crop(decode_jpeg(batches[0], device=DEV))
    sync()
    t0 = time.perf_counter()
    for _ in range(passes):
        for b in batches:
            crop(decode_jpeg(b, device=DEV))
    sync()
    return passes * n / (time.perf_counter() - t0)


def nvjpeg_vs_bare(args: argparse.Namespace, path: Path, batch: int, rrc: Any) -> dict[str, Any]:
    """The nvJPEG lane alone vs a bare loop over the same cache and batch, alternated: the loader decoding
    only (its batches handed over as lists) vs bare ``decode_jpeg``, and with its crop vs bare decode +
    crop; with the per-batch breakdown of each. (A decode on its own stream, not waiting for the previous
    crop, measured no better on the H200: results/jpeg_lanes_h200/README.md.)"""
    runs: dict[str, list[float]] = {}
    parts: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.repeats + 1):
        runs.setdefault("bare", []).append(bare_rate(path, batch, passes=args.lanes_epochs))
        runs.setdefault("bare_with_crop", []).append(
            bare_crop_rate(path, batch, rrc, passes=args.lanes_epochs)
        )
        for key, tf in (("decode_only", _as_list), ("with_crop", rrc)):
            ld = DecodeLoader(path, batch, transform=tf, device=DEV, lanes=["nvjpeg"])
            try:
                t = timed_loader(ld, args.lanes_epochs)
            finally:
                ld.close()
            runs.setdefault(f"loader_{key}", []).append(t["img_s"])
            parts.setdefault(f"loader_{key}", []).append(t)
    med = {k: float(np.median(v)) for k, v in runs.items()}
    over = {
        k: med[k] / med["bare_with_crop" if "with_crop" in k else "bare"]
        for k in med
        if k.startswith("loader")
    }
    for k in ("decode_only",):
        target(
            f"lanes: DecodeLoader nvJPEG-only ({k}) vs bare batched decode_jpeg, {path.name} bs{batch}",
            med[f"loader_{k}"],
            med["bare"],
            0.9,
        )
    return {
        "runs": runs,
        "median": med,
        "over_bare": over,
        "parts": parts,
    }


def _fixed_sweep(hw: bool, cpu: bool, coarse: bool = False) -> list[dict[str, float]]:
    if not cpu:
        return (
            [{"hw": 0.5, "nvjpeg": 0.5}, {"hw": 0.35, "nvjpeg": 0.65}, {"hw": 0.65, "nvjpeg": 0.35}]
            if hw
            else []
        )
    gpu = ["hw", "nvjpeg"] if hw else ["nvjpeg"]
    out = []
    for c in (1.0, 0.85, 0.7, 0.5, 0.3, 0.15, 0.0) if not coarse else (1.0, 0.7, 0.4, 0.0):
        out.append({"cpu": c} | {g: (1 - c) / len(gpu) for g in gpu})
    return out


def train_runs(
    args: argparse.Namespace,
    work: Path,
    model: str,
    px: int,
    res: int,
    batch: int,
    cpu: int,
    hw: bool,
    gpu_only: bool,
) -> dict[str, Any]:
    path = work / f"jpeg_short{px}"
    step, synthetic, rrc = training_setup(model, res, batch)
    lanes = ["cpu", "hw", "nvjpeg"] if hw else ["cpu", "nvjpeg"]
    loaders: dict[str, DecodeLoader] = {"auto": _loader(path, batch, rrc, lanes, cpu)}
    if gpu_only and not args.lanes_short_sweep:
        if hw:
            loaders["auto_gpu_lanes"] = _loader(path, batch, rrc, [n for n in lanes if n != "cpu"], 0)
        loaders["nvjpeg_only"] = _loader(path, batch, rrc, ["nvjpeg"], 0)
    if args.lanes_short_sweep:  # the two ends, and the measured split without the hardware lane
        loaders["auto_cpu_nvjpeg"] = _loader(path, batch, rrc, ["cpu", "nvjpeg"], cpu)
    for v in (v for v in getattr(args, "train_variants", "").split(",") if v):
        loaders[f"auto{v}"] = _loader(path, batch, rrc, lanes, cpu, variant=v)
    short = (
        [{"cpu": 1.0}]
        + ([{"cpu": 0.5, "hw": 0.25, "nvjpeg": 0.25}] if hw else [])
        + [{"cpu": 0.5, "nvjpeg": 0.5}]
    )
    for split in _fixed_sweep(hw, True, coarse=model == "resnet50") if not args.lanes_short_sweep else short:
        name = "fixed_" + "_".join(f"{k}{v:.2f}" for k, v in split.items())
        loaders[name] = _loader(path, batch, rrc, lanes, cpu, split)
    cfgs: dict[str, Any] = {"synthetic": lambda: timed_steps(synthetic, step, args.warmup, args.steps, batch)}
    for name, ld in loaders.items():
        cfgs[name] = lambda ld=ld: timed_steps(lambda: iter(ld), step, args.warmup, args.steps, batch)
    runs: dict[str, list[float]] = {k: [] for k in cfgs}
    names = list(cfgs)
    warm: dict[str, float] = {}
    try:
        # the measured split settles over its first ~100 batches (a training run has thousands): the auto
        # loader's are run untimed first, at their rate recorded apart ("auto_warm_img_s")
        for name in (n for n in loaders if n.startswith("auto") and args.lanes_auto_warm > 0):
            warm[name] = timed_steps(lambda n=name: iter(loaders[n]), step, 0, args.lanes_auto_warm, batch)
        for r in range(args.repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                runs[name].append(cfgs[name]())
    finally:
        for ld in loaders.values():
            ld.close()
    med = {k: float(np.median(v)) for k, v in runs.items()}
    ceiling = med["synthetic"]
    fixed = {k: v for k, v in med.items() if k.startswith("fixed_")}
    best = max(fixed, key=fixed.get) if fixed else None  # type: ignore[arg-type]
    out = {
        "model": model,
        "res": res,
        "batch": batch,
        "cpu_decoders": cpu,
        "lanes": loaders["auto"].split.lanes,
        "runs": runs,
        "median": med,
        "of_ceiling": {k: v / ceiling for k, v in med.items()},
        "best_fixed": best,
        "auto_vs_best_fixed": med["auto"] / fixed[best] if best else None,
        "auto_shares": loaders["auto"].split.shares(),
        "auto_rates": loaders["auto"].split.rates(),
        "auto_next_counts": loaders["auto"].split.counts(batch),
        "auto_period_s": loaders["auto"].split.last_period,
        "auto_warm_batches": args.lanes_auto_warm,
        "auto_warm_img_s": warm,
        "auto_tuner": {
            k: dataclasses.asdict(ld.split.tuner) for k, ld in loaders.items() if ld.split.fixed is None
        },
        "stats": {k: vars(ld.stats) for k, ld in loaders.items()},
    }
    log(
        f"train {model}@{res} cpu{cpu}: ceiling {ceiling:,.0f}; auto {med['auto']:,.0f} ({med['auto'] / ceiling:.3f}); best fixed {best} {fixed.get(best, 0):,.0f}; auto/best {out['auto_vs_best_fixed']}"
    )
    return out


def _lanes_pixels(work: Path, hw: HardwareJpeg | None) -> dict[str, Any]:
    """The hardware lane's and nvJPEG's pixels vs Pillow's decode of the same payloads."""
    from dlstore.read.gpu_decode import decode_on_device

    cache = open_cache(work / "jpeg_short256")
    idx = np.arange(min(512, len(cache)))
    payloads, shapes = cache.read_payloads(idx)
    ref = cache.read_images(idx)  # the CPU path (simplejpeg or Pillow)
    import io

    from PIL import Image

    pil = [np.asarray(Image.open(io.BytesIO(bytes(p))).convert("RGB")) for p in payloads]
    out: dict[str, Any] = {
        "images": len(idx),
        "cpu_path_vs_pillow_mean_abs": float(
            np.mean([np.abs(a.astype(int) - b).mean() for a, b in zip(ref, pil)])
        ),
    }
    lanes = {"nvjpeg": decode_on_device(cache, payloads, shapes, cache.positions[idx], torch.device(DEV))[0]}
    if hw is not None:
        lanes["hw"] = hw.decode(payloads)
    for name, imgs in lanes.items():
        diffs = [
            np.abs(img.permute(1, 2, 0).cpu().numpy().astype(int) - p.astype(int))
            for img, p in zip(imgs, pil)
            if img is not None
        ]
        out[name] = {
            "decoded": len(diffs),
            "mean_abs": float(np.mean([d.mean() for d in diffs])),
            "max": int(max(d.max() for d in diffs)),
        }
    log(f"pixels vs Pillow: {out}")
    return out


def _config_lanes(cfg: str, t: dict[str, Any]) -> tuple[list[str], dict[str, float] | None]:
    """The lanes a ``train_runs`` configuration ran and its fixed split (None: measured)."""
    if cfg == "nvjpeg_only":
        return ["nvjpeg"], None
    if cfg == "auto_gpu_lanes":
        return [n for n in t["lanes"] if n != "cpu"], None
    if cfg.startswith("auto"):
        return (["cpu", "nvjpeg"] if cfg == "auto_cpu_nvjpeg" else list(t["lanes"])), None
    shares = {}
    for part in cfg.removeprefix("fixed_").split("_"):
        name = part.rstrip("0123456789.")
        shares[name] = float(part[len(name) :])
    return [n for n in shares if shares[n] > 0], {n: v for n, v in shares.items() if v > 0}


def lanes_recommend(train: dict[str, Any], close: float = 0.05) -> dict[str, Any]:
    """Per model (over its CPU-decoder settings): the lanes, ``cpu_decoders`` and split measured fastest,
    as text and the DecodeLoader arguments; the measured split where it is within ``close`` of the
    fastest (it follows the step when that changes, a fixed one does not)."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for key, t in train.items():
        if not isinstance(t, dict) or "median" not in t:
            continue
        for cfg, rate in t["median"].items():
            if cfg == "synthetic":
                continue
            lanes, split = _config_lanes(cfg, t)
            cpu = t["cpu_decoders"] if "cpu" in lanes else 0
            row = {"setting": key, "config": cfg, "lanes": lanes, "cpu_decoders": cpu, "split": split}
            row |= {"img_s": rate, "of_ceiling": t["of_ceiling"].get(cfg), "batch": t["batch"]}
            rows.setdefault(f"{t['model']}@{t['res']}", []).append(row)
    out: dict[str, Any] = {}
    for model, rs in rows.items():
        best = max(rs, key=lambda r: r["img_s"])
        auto = [r for r in rs if r["split"] is None and r["img_s"] >= (1 - close) * best["img_s"]]
        pick = max(auto, key=lambda r: r["img_s"]) if auto else best
        split = "" if pick["split"] is None else f", split={pick['split']}"
        code = (
            f"DecodeLoader(cache, {pick['batch']}, transform=crop, cpu_decoders={pick['cpu_decoders']}, "
            f"lanes={pick['lanes']}{split})"
        )
        text = (
            f"{model}: lanes {'+'.join(pick['lanes'])} with cpu_decoders={pick['cpu_decoders']}"
            + (
                ""
                if len(pick["lanes"]) < 2
                else " (measured split)"
                if pick["split"] is None
                else " (fixed split)"
            )
            + f", {pick['img_s']:,.0f} img/s"
            + (f" ({pick['of_ceiling']:.3f} of the ceiling)" if pick["of_ceiling"] else "")
            + (
                f"; fastest measured: {best['config']} in {best['setting']}, {best['img_s']:,.0f}"
                if pick is not best
                else ""
            )
        )
        out[model] = pick | {"code": code, "text": text, "fastest": best}
    return out


def _hardware_lane() -> Any:
    """The hardware JPEG lane (nvImageCodec, NVJPG) where it exists here, else None."""
    return HardwareJpeg.open(torch.device(DEV)) if DEV == "cuda" else None


def section_lanes_pixels(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    hw = _hardware_lane()
    try:
        from nvidia import nvimgcodec

        version = nvimgcodec.__version__
    except Exception as e:
        version = f"absent: {e}"
    return {"hw_lane": hw is not None, "nvimgcodec": version, **_lanes_pixels(work, hw)}


def section_lanes_bare(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    return _lanes_bare(args, work, _hardware_lane())


def section_lanes_loader(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    return _lanes_loader(args, work, _hardware_lane() is not None)


def section_lanes_train(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """ResNet-18 @112 and ResNet-50 @224 (and ResNet-18 with 2 CPU decoders): the measured split vs a
    sweep of fixed splits; ``recommend`` names the fastest per model."""
    c, hw = decoder_counts(args)[0], args.lanes_hw and _hardware_lane() is not None
    plan = {
        "resnet18_112": ("resnet18", 128, 112, 512 // args.batch_div, c),
        "resnet18_112_cpu2": ("resnet18", 128, 112, 512 // args.batch_div, 2),
        "resnet50_224": ("resnet50", 256, 224, 256 // args.batch_div, c),
    }
    out: dict[str, Any] = {}
    for k in args.lanes_models.split(","):
        out[k] = train_runs(args, work, *plan[k], hw, not k.endswith("cpu2"))
        auto_vs_best_target(out[k])
        (args.out / "lanes_train_partial.json").write_text(json.dumps(out, indent=1, default=str))
    rec = lanes_recommend(out)
    for r in rec.values():
        log(f"recommended: {r['text']}; {r['code']}")
    return out | {"recommend": rec}


def auto_vs_best_target(t: dict[str, Any]) -> None:
    """Issue 27 item 2: the measured split within 5% of the best fixed split of the same run."""
    best = t.get("best_fixed")
    if best:
        target(
            f"lanes: {t['model']} @{t['res']} bs{t['batch']} cpu_decoders={t['cpu_decoders']}, measured split vs best fixed ({best})",
            t["median"]["auto"],
            t["median"][best],
            0.95,
        )


# --- issue 27: the engines section: each decoder bare, the per-image Python, the loader without it ----------
# python benchmarks/jpeg_cache.py --out OUT --caches jpeg_short128,jpeg_short256 --cpu-decoders 12 \
#   --sections data,engines
# Needs nvImageCodec (nvidia-nvimgcodec-cu13) for its hardware parts; without it (or on CPU, where its
# CPU backend stands in: a dry run, the numbers mean nothing) they are skipped.

# nvImageCodec decoders measured bare: (backends as (BackendKind, load hint), CPU threads). "default":
# every backend nvImageCodec has (its own multi-backend choice); DALI 2.4's mixed decoder is the
# hardware backend with hw_decoder_load 0.65-0.9 and the CUDA one behind it.
ENGINES: dict[str, tuple[tuple[tuple[str, float], ...], int]] = {
    "hw": ((("HW_GPU_ONLY", 1.0),), 2),
    "hw0.65+cuda": ((("HW_GPU_ONLY", 0.65), ("GPU_ONLY", 1.0)), 2),
    "hw0.9+cuda": ((("HW_GPU_ONLY", 0.9), ("GPU_ONLY", 1.0)), 2),
    "hw0.65+hybrid": ((("HW_GPU_ONLY", 0.65), ("HYBRID_CPU_GPU", 1.0)), 4),
    "default_2cpu": ((), 2),
    "default_4cpu": ((), 4),
    "default_8cpu": ((), 8),
}
# Run 3's DALI figures (pre-resized folder, loader alone, best of 12/16 threads; results/jpeg_lanes_h200)
DALI_RUN3 = {128: 29_899.0, 256: 23_026.0}


def _engine(backends: tuple[tuple[str, float], ...], threads: int) -> Any:
    """An nvImageCodec lane with these backends, or None; on CPU its CPU backend (dry runs only)."""
    if DEV == "cuda":
        return HardwareJpeg.open(torch.device(DEV), cpu_threads=threads, backends=backends)
    try:
        from nvidia import nvimgcodec

        return HardwareJpeg(torch.device("cpu"), nvimgcodec, cpu_threads=1, backends=(("CPU_ONLY", 1.0),))
    except Exception:
        return None


def _engines_bare(args: argparse.Namespace, path: Path, batch: int) -> dict[str, Any]:
    """img/s of each decoder alone on pre-read payloads, and of the two GPU lanes at once."""
    from torchvision.io import decode_jpeg

    views, tensors = _batches(path, batch)
    nb = len(views)
    hwc = open_cache(path).read_payloads(np.arange(nb * batch))[1]
    nbytes = [np.prod(hwc[a : a + batch], axis=1) for a in range(0, nb * batch, batch)]
    secs = args.lanes_seconds
    out: dict[str, Any] = {"batch": batch}
    out["nvjpeg"] = _rate(lambda i: decode_jpeg(tensors[i], device=DEV), nb, batch, secs)
    lanes: dict[str, Any] = {}
    for name, (backends, threads) in ENGINES.items():
        lane = _engine(backends, threads)
        if lane is None:
            out[name] = None
            continue
        lanes[name] = lane
        try:
            if lane.into:
                out[f"{name}_slots"] = _rate(
                    lambda i, ln=lane: ln.decode_into(views[i], nbytes[i]), nb, batch, secs
                )
            if name == "hw" or not lane.into:  # a tensor per image (the lane as it was)
                out[f"{name}_tensors"] = _rate(lambda i, ln=lane: ln.decode(views[i]), nb, batch, secs)
        except Exception as e:  # record it and go on with the next decoder
            out[f"{name}_error"] = f"{type(e).__name__}: {e}"
        log(
            f"bare {path.name} {name}: " + ", ".join(f"{k} {v}" for k, v in out.items() if k.startswith(name))
        )
    if "hw" in lanes and lanes["hw"].into:
        hw = lanes["hw"]
        fns = [lambda i: hw.decode_into(views[i], nbytes[i]), lambda i: decode_jpeg(tensors[i], device=DEV)]
        out["hw+nvjpeg"] = _together(fns, nb, batch, secs)
        # Beside a thread running Python (a training loop's launches): nvImageCodec takes the GIL back
        # per image inside its batched call, torchvision's call does not; and with a 0.5 ms switch interval
        out["beside_python"] = {
            "hw_slots": _beside_python(fns[0], nb, batch, secs),
            "nvjpeg": _beside_python(fns[1], nb, batch, secs),
            "hw_slots_switch_0.5ms": _beside_python(fns[0], nb, batch, secs, switch=0.0005),
            "nvjpeg_switch_0.5ms": _beside_python(fns[1], nb, batch, secs, switch=0.0005),
        }
    log(f"bare {path.name}: " + ", ".join(f"{k} {v:,.0f}" for k, v in out.items() if isinstance(v, float)))
    return out


def _together(fns: list[Any], nb: int, batch: int, seconds: float) -> float:
    """img/s of the ``fns`` each looping over the batches in a thread of its own, all at once."""
    counts = [0] * len(fns)
    stop = time.perf_counter() + seconds

    def run(k: int) -> None:
        while time.perf_counter() < stop:
            fns[k](counts[k] % nb)
            counts[k] += 1

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(fns))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sync()
    return sum(counts) * batch / (time.perf_counter() - t0)


def _beside_python(fn: Any, nb: int, batch: int, seconds: float, switch: float | None = None) -> float:
    """img/s of ``fn`` over the batches while another thread runs Python all the time."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            busy_python(0.001)

    old = sys.getswitchinterval()
    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        if switch is not None:
            sys.setswitchinterval(switch)
        return _rate(fn, nb, batch, seconds)
    finally:
        sys.setswitchinterval(old)
        stop.set()
        t.join()


def _ms(fn: Callable[[], Any], reps: int = 10) -> float:
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return 1e3 * (time.perf_counter() - t0) / reps


def _python_costs(path: Path, batch: int) -> dict[str, float]:
    """ms per batch of each per-image step the loader did (or does) around its decode calls."""
    import warnings

    from torchvision.io import decode_jpeg

    from dlstore.gpu.ragged import _flat_host, scattered_flat
    from dlstore.read.gpu_decode import as_tensors

    views, tensors = _batches(path, batch)
    hwc = open_cache(path).read_payloads(np.arange(batch))[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        images = decode_jpeg(tensors[0], device=DEV)
    out = {
        "np_frombuffer": _ms(lambda: [np.frombuffer(p, np.uint8) for p in views[0]]),
        "torch_frombuffer": _ms(lambda: as_tensors(views[0])),
        "reshape_cat": _ms(lambda: torch.cat([img.reshape(-1) for img in images])),
        "flat_host": _ms(lambda: _flat_host(images)),
        "data_ptrs": _ms(lambda: [img.data_ptr() for img in images]),
        "scattered_flat": _ms(
            lambda: scattered_flat(
                images[0], np.fromiter((t.data_ptr() for t in images), np.int64, batch), hwc, list
            )
        ),
    }
    lane = _engine(*ENGINES["hw"])
    if lane is not None:
        from nvidia import nvimgcodec

        out["codestreams"] = _ms(
            lambda: [nvimgcodec.CodeStream(np.frombuffer(p, np.uint8)) for p in views[0]]
        )
        raw = lane._call([np.frombuffer(p, np.uint8) for p in views[0]], None)
        out["as_tensor"] = _ms(lambda: [lane._tensor(img) for img in raw])
        key = "__cuda_array_interface__" if DEV == "cuda" else "__array_interface__"
        out["array_interface_ptr"] = _ms(lambda: [getattr(img, key)["data"][0] for img in raw])
        out["image_shapes"] = _ms(lambda: [img.shape for img in raw])
    costs = ", ".join(f"{k} {v:.3f}" for k, v in out.items())
    log(f"per batch of {batch}, ms: {costs}")
    return out


ENGINE_SETS = {
    "nvjpeg": ["nvjpeg"],
    "hw": ["hw"],
    "hw+nvjpeg": ["hw", "nvjpeg"],
    "cpu+nvjpeg": ["cpu", "nvjpeg"],
    "cpu+hw+nvjpeg": ["cpu", "hw", "nvjpeg"],
}


def _best_mixed(bare: dict[str, Any]) -> str | None:
    """The nvImageCodec multi-backend decoder that decoded fastest bare (into slots), if any ran."""
    rates = {
        k.removesuffix("_slots"): v
        for k, v in bare.items()
        if k.endswith("_slots") and k != "hw_slots" and isinstance(v, float)
    }
    return max(rates, key=rates.get) if rates else None  # type: ignore[arg-type]


def _engines_loader(
    args: argparse.Namespace, path: Path, res: int, batch: int, mixed: str | None
) -> dict[str, Any]:
    """DecodeLoader alone per lane set (measured split): scattered batches (this design) and copied into
    one buffer (``_copied``, the design before); without CPU decoders, reads also held until the
    device call returns (``_reads_after``); the ``mixed`` nvImageCodec decoder (hardware + CUDA
    backends in one call) as the only GPU lane, alone and beside the CPU; the bare decode_jpeg loop.
    ``--engines-repeats`` rounds, the order rotated; the median."""
    rrc = RaggedRandomResizedCrop(res, mean=MEAN, std=STD, out_dtype=torch.bfloat16, channels_last=True).to(
        DEV
    )
    cpu = decoder_counts(args)[0] if decoder_counts(args) else 0
    sets = (
        ENGINE_SETS
        if args.engines_sets == "all"
        else {k: ENGINE_SETS[k] for k in args.engines_sets.split(",")}
    )
    variants = [v for v in args.engines_variants.split(",") if v]
    plan = [(name, lanes, "") for name, lanes in sets.items()]
    plan += [
        (name, lanes, v)
        for name, lanes in sets.items()
        for v in variants
        if v == "_copied"
        or v.startswith("_process")
        or (v in ("_reads_after", "_gated_after") and (v == "_reads_after") == ("cpu" not in lanes))
    ]
    if mixed is not None and DEV == "cuda":
        plan += [(f"mixed:{mixed}", ["hw"], ""), (f"cpu+mixed:{mixed}", ["cpu", "hw"], "")]
    fixed = _fixed_splits(args.engines_loader_fixed)
    plan += [(f"fixed:{spec}", list(split), "") for spec, split in fixed.items()]
    runs: dict[str, list[dict[str, Any]]] = {}
    bare: list[float] = []
    for r in range(args.engines_repeats):
        bare.append(bare_rate(path, batch, passes=args.lanes_epochs))
        for name, lanes, variant in plan[r % len(plan) :] + plan[: r % len(plan)]:
            key = name + variant
            ld = _loader(
                path, batch, rrc, lanes, cpu, split=fixed.get(name[len("fixed:") :]), variant=variant
            )
            if name.startswith("fixed:") and set(ld.split.lanes) != set(lanes):  # a lane absent here
                ld.close()
                continue
            if name.startswith(("mixed", "cpu+mixed")):  # the hardware lane's decoder swapped
                engine = _engine(*ENGINES[mixed]) if ld.hw is not None else None  # type: ignore[index]
                if engine is None:
                    ld.close()
                    continue
                ld.hw = engine
            try:
                t = timed_loader(ld, args.lanes_epochs)
            finally:
                ld.close()
            runs.setdefault(key, []).append(
                t | {"lanes": ld.split.lanes, "shares": ld.split.shares(), "rerouted": ld.stats.rerouted}
            )
            log(f"loader {path.name} {key} ({'+'.join(ld.split.lanes)}): {t['img_s']:,.0f} img/s")
    out: dict[str, Any] = {"bare_decode_jpeg": float(np.median(bare)), "bare_runs": bare}
    for key, rs in runs.items():
        best = sorted(rs, key=lambda t: t["img_s"])[len(rs) // 2]  # the median run (upper, of two)
        out[key] = best | {
            "img_s": float(np.median([t["img_s"] for t in rs])),
            "img_s_runs": [t["img_s"] for t in rs],
        }
    return out


def _fixed_splits(spec: str) -> dict[str, dict[str, float]]:
    """``--engines-loader-fixed`` ("cpu0.4+nvjpeg0.6,cpu0.3+hw0.35+nvjpeg0.35") as {spec: {lane: share}}."""
    out: dict[str, dict[str, float]] = {}
    for item in (v for v in spec.split(",") if v):
        parts = [re.fullmatch(r"([a-z]+)([0-9.]+)", p) for p in item.split("+")]
        if not all(parts):
            raise SystemExit(f"--engines-loader-fixed: {item!r} is not like cpu0.4+nvjpeg0.6")
        out[item] = {m.group(1): float(m.group(2)) for m in parts if m}
    return out


def _variant(ld: DecodeLoader, variant: str) -> DecodeLoader:
    """``_copied``: batches copied into one buffer (the design before); ``_reads_after``: reads held
    until the device call returns; ``_gated_after``: the same with CPU decoders (reads gated);
    ``_stream``: ``decode_in="stream"``; ``_processN``: set when the loader is made (``_loader``)."""
    ld.scatter = variant != "_copied"
    ld.read_during_decode = variant not in ("_reads_after", "_gated_after")
    if variant == "_gated_after":
        ld.gate_reads = True
    if variant == "_stream":  # decoded in the caller's thread between its steps (no GIL contention)
        ld.decode_in = "stream"
    return ld


def _engines_train(args: argparse.Namespace, work: Path, hw: bool) -> dict[str, Any]:
    """ResNet-50 @224 (bs 256) from the GPU lanes only: nvJPEG alone, both lanes measured, hardware-heavy
    fixed splits; and ResNet-18 @112 with the CPU decoders (issue 27's 0.85 target) with and without
    the hardware lane."""
    batch = 256 // args.batch_div
    path = work / "jpeg_short256"
    step, synthetic, rrc = training_setup("resnet50", 224, batch)
    loaders = {"nvjpeg_only": _loader(path, batch, rrc, ["nvjpeg"], 0)}
    if hw:
        loaders["auto_gpu_lanes"] = _loader(path, batch, rrc, ["hw", "nvjpeg"], 0)
        copied = loaders["auto_gpu_lanes_copied"] = _loader(path, batch, rrc, ["hw", "nvjpeg"], 0)
        copied.scatter = False
        after = loaders["auto_gpu_lanes_reads_after"] = _loader(path, batch, rrc, ["hw", "nvjpeg"], 0)
        after.read_during_decode = False
        loaders["auto_gpu_lanes_stream"] = _variant(_loader(path, batch, rrc, ["hw", "nvjpeg"], 0), "_stream")
    for v in (v for v in args.engines_variants.split(",") if v.startswith("_process")):
        loaders[f"auto_gpu_lanes{v}"] = _loader(
            path, batch, rrc, ["hw", "nvjpeg"] if hw else ["nvjpeg"], 0, variant=v
        )
        for share in (float(v) for v in args.engines_r50_fixed.split(",") if v):
            split = {"hw": share, "nvjpeg": 1.0 - share}
            loaders[f"fixed_hw{share:.2f}_nvjpeg{1 - share:.2f}"] = _loader(
                path, batch, rrc, ["hw", "nvjpeg"], 0, split
            )
    cfgs: dict[str, Callable[[], float]] = {
        "synthetic": lambda: timed_steps(synthetic, step, args.warmup, args.steps, batch)
    }
    for name, ld in loaders.items():
        cfgs[name] = lambda ld=ld: timed_steps(lambda: iter(ld), step, args.warmup, args.steps, batch)
    runs: dict[str, list[float]] = {k: [] for k in cfgs}
    names = list(cfgs)
    try:
        for name in (n for n in loaders if n.startswith("auto") and args.lanes_auto_warm > 0):
            timed_steps(lambda n=name: iter(loaders[n]), step, 0, args.lanes_auto_warm, batch)
        for r in range(args.repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                runs[name].append(cfgs[name]())
    finally:
        for ld in loaders.values():
            ld.close()
    med = {k: float(np.median(v)) for k, v in runs.items()}
    r50 = {
        "runs": runs,
        "median": med,
        "of_ceiling": {k: v / med["synthetic"] for k, v in med.items()},
        "stats": {k: vars(ld.stats) for k, ld in loaders.items()},
        "shares": {k: ld.split.shares() for k, ld in loaders.items()},
    }
    log(f"resnet50@224 GPU lanes only: {r50['of_ceiling']}")
    out: dict[str, Any] = {"resnet50_224_gpu_lanes": r50}
    (args.out / "engines_train_partial.json").write_text(json.dumps(out, indent=1, default=str))
    cpu = decoder_counts(args)[0] if decoder_counts(args) else 0
    if cpu:
        short, args.lanes_short_sweep = args.lanes_short_sweep, True
        args.train_variants = ",".join(
            v
            for v in args.engines_variants.split(",")
            if v in ("_gated_after", "_stream") or v.startswith("_process")
        )
        try:
            out["resnet18_112"] = train_runs(
                args, work, "resnet18", 128, 112, 512 // args.batch_div, cpu, hw, False
            )
        finally:
            args.lanes_short_sweep = short
    return out


def section_engines(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Each decoder bare (torchvision nvJPEG, nvImageCodec hardware-only and its multi-backend
    decoders, both GPU lanes at once), the per-image Python steps, DecodeLoader alone per lane set
    (scattered vs copied), ResNet-50 @224 from the GPU lanes only and ResNet-18 @112 with the CPU."""
    try:
        from nvidia import nvimgcodec

        version = nvimgcodec.__version__
    except Exception as e:
        version = f"absent: {e}"
    hw = _engine(*ENGINES["hw"]) is not None and DEV == "cuda"
    out: dict[str, Any] = {"nvimgcodec": version, "hw_lane": hw}
    sizes = [int(v) for v in args.lanes_sizes.split(",")]
    geometry = [g for g in ((128, 112, 512), (256, 224, 256)) if g[0] in sizes]
    parts = args.engines_parts.split(",")
    for px, _res, batch in geometry if "bare" in parts else []:
        out[f"bare_{px}px"] = _engines_bare(args, work / f"jpeg_short{px}", batch // args.batch_div)
    if "costs" in parts:
        out["python_costs_128px"] = _python_costs(work / "jpeg_short128", 512 // args.batch_div)
    (args.out / "engines_partial.json").write_text(json.dumps(out, indent=1, default=str))
    for px, res, batch in geometry if "loader" in parts else []:
        mixed = _best_mixed(out[f"bare_{px}px"]) if f"bare_{px}px" in out else args.engines_mixed
        r = out[f"loader_{px}px"] = _engines_loader(
            args, work / f"jpeg_short{px}", res, batch // args.batch_div, mixed
        )
        (args.out / "engines_partial.json").write_text(json.dumps(out, indent=1, default=str))
        _engines_loader_targets(px, batch, r)
    if "train" not in parts:
        return out
    out["train"] = _engines_train(args, work, hw)
    r50 = out["train"]["resnet50_224_gpu_lanes"]
    best = max((k for k in r50["median"] if k != "synthetic"), key=r50["median"].get)
    target(
        f"engines: ResNet-50 @224 from the GPU lanes only ({best}) vs synthetic",
        r50["median"][best],
        r50["median"]["synthetic"],
        0.97,
    )
    r18 = out["train"].get("resnet18_112")
    if r18:
        target(
            f"engines: ResNet-18 @112 bs512, measured split (lanes {'+'.join(r18['lanes'])}) vs synthetic",
            r18["median"]["auto"],
            r18["median"]["synthetic"],
            0.85,
        )
    return out


def _engines_loader_targets(px: int, batch: int, r: dict[str, Any]) -> None:
    gpu = {k: v["img_s"] for k, v in r.items() if isinstance(v, dict) and "cpu" not in k}
    every = {k: v["img_s"] for k, v in r.items() if isinstance(v, dict)}
    if not gpu:
        return
    g, a = max(gpu, key=gpu.get), max(every, key=every.get)  # type: ignore[arg-type]
    target(
        f"engines: loader alone {px}px bs{batch}, GPU lanes only ({g}) vs DALI run 3",
        gpu[g],
        DALI_RUN3[px],
        1.0,
    )
    goal = 2.0 if px == 128 else 1.5
    target(f"engines: loader alone {px}px bs{batch}, best ({a}) vs DALI run 3", every[a], DALI_RUN3[px], goal)
    for key in (k for k in r if k == "nvjpeg" or k.startswith(("nvjpeg_reads_after", "nvjpeg_process"))):
        target(
            f"engines: loader {key} vs bare batched decode_jpeg, {px}px bs{batch}",
            r[key]["img_s"],
            r["bare_decode_jpeg"],
            0.9,
        )


# --- issue 27: DALI side by side (the same photographs, one run) ---------------------------------------
# python benchmarks/jpeg_cache.py --out OUT --caches jpeg_short128,jpeg_short256 --cpu-decoders 12 \
#   --sections data,side_by_side,lanes_train


def folder_from_cache(cache_path: Path, dest: Path) -> Path:
    """The cache's JPEG payloads written as files of an ImageFolder tree (its labels as class folders):
    the same bytes dlstore's DecodeLoader reads, for DALI's ``readers.file``."""
    if dest.exists():
        return dest
    cache = open_cache(cache_path)
    payloads, _ = cache.read_payloads(np.arange(len(cache)))
    for i, (p, label) in enumerate(zip(payloads, cache.labels.tolist())):
        cls = dest / f"class{int(label)}"
        cls.mkdir(parents=True, exist_ok=True)
        (cls / f"{i:06d}.jpg").write_bytes(bytes(p))
    return dest


def dali_version() -> str | None:
    """DALI's version where ``nvidia.dali`` imports here, else None."""
    try:
        import nvidia.dali as dali

        return str(dali.__version__)
    except Exception:
        return None


class DaliBatches:
    """DALI 2.x's standard ImageNet training pipeline over an ImageFolder tree, as (x, y) torch batches
    on the GPU like dlstore's: ``readers.file`` (shuffled) -> ``decoders.image_random_crop`` on the
    ``mixed`` backend (nvJPEG and the hardware JPEG engines) -> ``resize`` to ``res``² ->
    ``crop_mirror_normalize`` (random flip, ImageNet mean/std, fp16 HWC) -> bf16 channels-last.
    Each ``iter()`` is one epoch (the last partial batch dropped)."""

    def __init__(self, root: Path, batch: int, res: int, threads: int, seed: int = 0) -> None:
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.plugin.base_iterator import LastBatchPolicy
        from nvidia.dali.plugin.pytorch import DALIGenericIterator

        @pipeline_def(batch_size=batch, num_threads=threads, device_id=torch.cuda.current_device(), seed=seed)
        def pipe() -> Any:
            jpegs, labels = fn.readers.file(file_root=str(root), random_shuffle=True, name="Reader")
            images = fn.decoders.image_random_crop(
                jpegs,
                device="mixed",
                output_type=types.RGB,
                random_area=[0.08, 1.0],
                random_aspect_ratio=[3 / 4, 4 / 3],
                num_attempts=100,
            )
            images = fn.resize(images, device="gpu", resize_x=res, resize_y=res)
            images = fn.crop_mirror_normalize(
                images,
                device="gpu",
                dtype=types.FLOAT16,
                output_layout="HWC",
                mean=[m * 255 for m in MEAN],
                std=[s * 255 for s in STD],
                mirror=fn.random.coin_flip(probability=0.5),
            )
            return images, labels.gpu()

        self.pipe = pipe()
        self.pipe.build()
        self.it = DALIGenericIterator(
            [self.pipe],
            ["x", "y"],
            reader_name="Reader",
            last_batch_policy=LastBatchPolicy.DROP,
            auto_reset=True,
        )

    def __iter__(self) -> Any:
        for out in self.it:
            d = out[0]
            # (B, H, W, C) fp16 -> the (B, C, H, W) view is channels-last in memory; bf16 keeps the strides
            yield d["x"].permute(0, 3, 1, 2).to(torch.bfloat16), d["y"].reshape(-1).long()

    def close(self) -> None:
        self.it = self.pipe = None  # type: ignore[assignment]


def _fail_soft(name: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, or a record of why it failed (one broken configuration must not lose the run)."""
    try:
        return fn()
    except Exception as e:
        log(f"{name}: {type(e).__name__}: {e}")
        return {"error": f"{type(e).__name__}: {e}"}


def _dali_train(cfg: tuple[Path, int, int, int], step: Any, args: argparse.Namespace) -> float:
    root, batch, res, threads = cfg
    d = DaliBatches(root, batch, res, threads)
    try:
        return timed_steps(lambda: iter(d), step, args.warmup, args.steps, batch)
    finally:
        d.close()


def _dali_alone(root: Path, batch: int, res: int, threads: int, epochs: int) -> float:
    d = DaliBatches(root, batch, res, threads)
    try:
        return loader_alone(d, epochs=epochs)[0]
    finally:
        d.close()


SIDE_MODELS = {  # model -> (res, batch, dlstore's cache px, DALI's pre-resized folder px)
    "resnet50_224": ("resnet50", 224, 256, 256),
    "resnet18_112": ("resnet18", 112, 512, 128),
}


# dlstore's rows (``--side-loaders``): row -> (lanes, variant); lanes absent here (no NVJPG) are left out
SIDE_LOADERS: dict[str, tuple[list[str], str]] = {
    "dlstore_nvjpeg": (["nvjpeg"], ""),
    "dlstore_nvjpeg_cpu": (["cpu", "nvjpeg"], ""),
    "dlstore_gpu_lanes": (["hw", "nvjpeg"], ""),
    "dlstore_all_lanes": (["cpu", "hw", "nvjpeg"], ""),
    "dlstore_gpu_lanes_process": (["hw", "nvjpeg"], "_process"),
    "dlstore_all_lanes_process": (["cpu", "hw", "nvjpeg"], "_process"),
    "dlstore_gpu_lanes_process2": (["hw", "nvjpeg"], "_process2"),
    "dlstore_all_lanes_process2": (["cpu", "hw", "nvjpeg"], "_process2"),
    "dlstore_nvjpeg_process2": (["nvjpeg"], "_process2"),
    "dlstore_nvjpeg_cpu_process2": (["cpu", "nvjpeg"], "_process2"),
}


SIDE_DEFAULT = (
    "dlstore_nvjpeg",
    "dlstore_nvjpeg_cpu",
    "dlstore_gpu_lanes",
    "dlstore_all_lanes",
)  # in-process


def _side_loaders(args: argparse.Namespace, alone: bool = False) -> dict[str, tuple[list[str], str]]:
    """The rows asked for: ``default`` (decoding in the training process, DecodeLoader's default; the
    decode-process rows trained slower in run 6), ``all``, or a comma list; ``alone``: with the rows of
    ``--side-alone-extra`` (the loader-alone table only)."""
    spec = args.side_loaders
    names = (
        list(SIDE_DEFAULT) if spec == "default" else list(SIDE_LOADERS) if spec == "all" else spec.split(",")
    )
    if alone and args.side_alone_extra:
        names += [n for n in args.side_alone_extra.split(",") if n not in names]
    return {n: SIDE_LOADERS[n] for n in names}


def section_side_by_side(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Issue 27's two tables in one run: the synthetic ceiling, DALI on the full-size and the pre-resized
    folder, dlstore's DecodeLoader with nvJPEG only and with nvJPEG + CPU decoders (measured split), per
    model; then each loader alone. DALI's rows are a clear record of why where it does not import."""
    cpu = decoder_counts(args)[0] if decoder_counts(args) else 0
    version = dali_version() if DEV == "cuda" else None
    dali_note = f"dali {version}" if version else "dali: not importable (or no GPU): its rows are absent"
    log(dali_note)
    folders = {"full": work / "photos"}
    for px in (128, 256):
        if (work / f"jpeg_short{px}").exists():
            folders[f"short{px}"] = folder_from_cache(work / f"jpeg_short{px}", work / f"folder_short{px}")
    out: dict[str, Any] = {"dali": dali_note, "dali_version": version, "cpu_decoders": cpu, "train": {}}
    out["alone"] = {}
    for key in SIDE_MODELS:
        if args.side_models == "all" or key in args.side_models.split(","):
            out["train"][key] = _fail_soft(
                key, lambda k=key: _side_train(args, work, k, folders, cpu, version)
            )
            _write_side(args, out)
    for key in SIDE_MODELS:
        if args.side_models == "all" or key in args.side_models.split(","):
            out["alone"][f"{SIDE_MODELS[key][3]}px"] = _fail_soft(
                key, lambda k=key: _side_alone(args, work, k, folders, cpu, version)
            )
            _write_side(args, out)
    _side_targets(out)
    _write_side(args, out)
    return out


def _side_train(
    args: argparse.Namespace, work: Path, key: str, folders: dict[str, Path], cpu: int, version: str | None
) -> dict[str, Any]:
    """One model's row set: ceiling, dlstore (nvJPEG; nvJPEG + CPU), DALI (full-size; pre-resized)."""
    model, res, batch, px = SIDE_MODELS[key]
    batch //= args.batch_div
    threads = min(12, CORES)
    step, synthetic, rrc = training_setup(model, res, batch)
    path = work / f"jpeg_short{px}"
    loaders = {
        name: _loader(path, batch, rrc, lanes, cpu, variant=v)
        for name, (lanes, v) in _side_loaders(args).items()
    }
    cfgs: dict[str, Callable[[], float]] = {
        "synthetic": lambda: timed_steps(synthetic, step, args.warmup, args.steps, batch),
        **{
            k: (lambda ld=ld: timed_steps(lambda: iter(ld), step, args.warmup, args.steps, batch))
            for k, ld in loaders.items()
        },
    }
    if version:
        cfgs["dali_full"] = lambda: _dali_train((folders["full"], batch, res, threads), step, args)
        cfgs["dali_short"] = lambda: _dali_train((folders[f"short{px}"], batch, res, threads), step, args)
    runs: dict[str, list[Any]] = {k: [] for k in cfgs}
    names = list(cfgs)
    warm = {  # the measured split settles first, untimed (as in lanes_train)
        name: _fail_soft(
            f"warm {name}", lambda ld=ld: timed_steps(lambda: iter(ld), step, 0, args.lanes_auto_warm, batch)
        )
        for name, ld in loaders.items()
    }
    try:
        for r in range(args.repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                runs[name].append(_fail_soft(f"{key} {name}", cfgs[name]))
                log(f"side by side {key} {name}: {runs[name][-1]}")
    finally:
        shares = {k: ld.split.shares() for k, ld in loaders.items()}
        for ld in loaders.values():
            ld.close()
    med = {k: float(np.median(v)) for k, v in runs.items() if v and all(isinstance(x, float) for x in v)}
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return {
        "model": model,
        "res": res,
        "batch": batch,
        "runs": runs,
        "median": med,
        "of_ceiling": {k: v / med["synthetic"] for k, v in med.items()} if "synthetic" in med else {},
        "dlstore_shares": shares,
        "dlstore_auto_warm": {"batches": args.lanes_auto_warm, "img_s": warm},
    }


def _side_alone(
    args: argparse.Namespace, work: Path, key: str, folders: dict[str, Path], cpu: int, version: str | None
) -> dict[str, Any]:
    """Each loader alone (no model): dlstore nvJPEG only and nvJPEG + CPU decoders from the shorter-px
    cache, DALI on the same bytes as a folder (12 and 16 threads) and on the full-size folder."""
    _model, res, batch, px = SIDE_MODELS[key]
    batch //= args.batch_div
    rrc = RaggedRandomResizedCrop(res, mean=MEAN, std=STD, out_dtype=torch.bfloat16, channels_last=True)
    rrc = rrc.to(DEV)
    r: dict[str, Any] = {}
    for name, (lanes, v) in _side_loaders(args, alone=True).items():
        ld = _loader(work / f"jpeg_short{px}", batch, rrc, lanes, cpu, variant=v)
        try:
            r[name] = _fail_soft(name, lambda ld=ld: loader_alone(ld, epochs=args.lanes_epochs)[0])
        finally:
            ld.close()
    if version:
        short, epochs = folders.get(f"short{px}", Path("absent")), args.lanes_epochs
        for threads in sorted({min(12, CORES), CORES}):
            r[f"dali_short_{threads}t"] = _fail_soft(
                f"dali alone {px}", lambda t=threads: _dali_alone(short, batch, res, t, epochs)
            )
        r["dali_full_12t"] = _fail_soft(
            "dali alone full", lambda: _dali_alone(folders["full"], batch, res, min(12, CORES), epochs)
        )
        best = [v for k, v in r.items() if k.startswith("dali_short") and isinstance(v, float)]
        r["dali_short_best"] = max(best) if best else None
    log(f"alone {px}px: {r}")
    return r


def _side_targets(out: dict[str, Any]) -> None:
    """Issue 27's targets from this section's figures (where both sides were measured): the best dlstore
    row of each kind, named (every row has the measured split); the default loader's row beside it."""
    tr, al = out["train"], out["alone"]

    def best(figures: dict[str, Any], gpu_only: bool) -> str | None:
        rows = [
            n
            for n in SIDE_LOADERS
            if isinstance(figures.get(n), float) and (not gpu_only or "cpu" not in SIDE_LOADERS[n][0])
        ]
        return max(rows, key=figures.get) if rows else None  # type: ignore[arg-type]

    m = tr.get("resnet18_112", {}).get("median", {})
    for name in {best(m, False), "dlstore_all_lanes"} - {None}:
        if name in m and "synthetic" in m:
            target(
                f"side by side: ResNet-18 @112 bs512 from the JPEG cache short-128, {name} (measured split)",
                m[name],
                m["synthetic"],
                0.85,
                note=f"DALI pre-resized {m.get('dali_short', float('nan')):,.0f} img/s",
            )
    m = tr.get("resnet50_224", {}).get("median", {})
    name = best(m, True)
    if name and "synthetic" in m:
        target(
            f"side by side: ResNet-50 @224 bs256 from the GPU lanes alone, {name}",
            m[name],
            m["synthetic"],
            0.97,
        )
    for px, goal in (("128px", 2.0), ("256px", 1.5)):
        r = al.get(px, {})
        dali = r.get("dali_short_best")
        if not dali:
            continue
        for gpu_only, want in ((False, goal), (True, 1.0)):
            name = best(r, gpu_only)
            if name:
                kind = "GPU lanes only" if gpu_only else "best"
                target(
                    f"side by side: loader alone {px}, {kind} ({name}) vs DALI's best on the same bytes",
                    r[name],
                    dali,
                    want,
                )


def _fmt(v: Any, ceiling: float | None = None) -> str:
    if not isinstance(v, float):
        return "–"
    return f"{v:,.0f}" + (f" ({v / ceiling:.2f})" if ceiling else "")


def side_tables(out: dict[str, Any]) -> str:
    """The section's two tables (markdown)."""
    tr, al = out["train"], out["alone"]
    keys = [k for k in SIDE_MODELS if k in tr]
    heads = {"resnet50_224": "ResNet-50 @224, bs 256", "resnet18_112": "ResNet-18 @112, bs 512"}
    mine = [n for n in SIDE_LOADERS if any(n in tr[k].get("median", {}) for k in keys)]
    rows = [
        ("synthetic ceiling", "synthetic"),
        ("DALI, full-size folder", "dali_full"),
        ("DALI, pre-resized folder (short 256 / 128)", "dali_short"),
        *((_side_label(n, out["cpu_decoders"]), n) for n in mine),
    ]
    lines = [
        f"{out['dali']}",
        "",
        "| img/s (of the synthetic ceiling) | " + " | ".join(heads[k] for k in keys) + " |",
    ]
    lines.append("|---|" + "---|" * len(keys))
    for label, name in rows:
        cells = []
        for k in keys:
            m = tr[k].get("median", {})
            cells.append(_fmt(m.get(name), None if name == "synthetic" else m.get("synthetic")))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    sizes = [px for px in ("256px", "128px") if px in al]
    lines += ["", "| img/s, loader alone | " + " | ".join(f"from short {p[:-2]}" for p in sizes) + " |"]
    lines.append("|---|" + "---|" * len(sizes))
    alone = [n for n in SIDE_LOADERS if any(n in al[p] for p in sizes)]
    for label, name in (
        ("DALI, pre-resized folder (best of 12/16 threads)", "dali_short_best"),
        ("DALI, full-size folder (12 threads)", "dali_full_12t"),
        *((_side_label(n, out["cpu_decoders"]), n) for n in alone),
    ):
        lines.append(f"| {label} | " + " | ".join(_fmt(al[p].get(name)) for p in sizes) + " |")
    return "\n".join(lines) + "\n"


def _side_label(name: str, cpu: int) -> str:
    """A dlstore row's words: its lanes (measured split) and where it decodes."""
    lanes, variant = SIDE_LOADERS[name]
    words = {"cpu": f"{cpu} CPU decoders", "hw": "hardware engines", "nvjpeg": "nvJPEG"}
    where = (
        f", in {variant[len('_process') :] or 1} decode process(es)" if variant.startswith("_process") else ""
    )
    return "dlstore, " + " + ".join(words[n] for n in lanes) + where


def _write_side(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """The section's figures so far (JSON and the markdown tables): a later time-out keeps them."""
    import json

    (args.out / "side_by_side.json").write_text(json.dumps(out, indent=1, default=str))
    (args.out / "side_by_side.md").write_text(side_tables(out))


SECTIONS: dict[str, Callable[[argparse.Namespace, Path], dict[str, Any]]] = {
    "data": section_data,
    "bytes": section_bytes,
    "decode": section_decode,
    "cpu_decode": section_cpu_decode,
    "resnet50": lambda a, w: section_train(a, w, "resnet50", 224, 256 // a.batch_div),
    "resnet18": lambda a, w: section_train(a, w, "resnet18", 112, 512 // a.batch_div),
    "hybrid": section_hybrid,
    "ladder": section_ladder,
    "lanes_pixels": section_lanes_pixels,
    "lanes_bare": section_lanes_bare,
    "lanes_train": section_lanes_train,
    "lanes_loader": section_lanes_loader,
    "side_by_side": section_side_by_side,
    "engines": section_engines,
}


environment = harness.environment


def main() -> None:
    ap = harness.parser(images=8192, warmup=8, steps=30, repeats=2)
    ap.add_argument("--cpu-batches", type=int, default=40)
    ap.add_argument(
        "--cpu-decode-with", default="pillow,simplejpeg", help="cpu_decode section: decoders tried"
    )
    ap.add_argument("--batch-div", type=int, default=1, help="smaller training batches (CPU dry runs)")
    ap.add_argument("--caches", default="all", help="data section: which caches to build (comma list)")
    ap.add_argument(
        "--cpu-decoders",
        default=str(max(1, CORES - 4)),
        help="CPU decode processes beside nvJPEG: a comma list (hybrid tries each; the first elsewhere); 0: none",
    )
    ap.add_argument("--shares", default="0.25,0.5,0.75", help="hybrid section: fixed CPU shares tried")
    ap.add_argument("--lean", action="store_true", help="resnet sections: the default loaders only")
    ap.add_argument(
        "--hybrid-gated",
        action="store_true",
        help="hybrid section: also the splits with the read-ahead gated",
    )
    ap.add_argument(
        "--hybrid-diagnostics",
        action="store_true",
        help="hybrid section: also the step beside busy CPU decoders only, and beside the crop only",
    )
    ap.add_argument(
        "--hybrid-device-boxes",
        action="store_true",
        help="hybrid section: also the crop drawing its boxes on the device (the design before 087ed1d)",
    )
    ap.add_argument("--hybrid-loaders", default="all", help="hybrid section: only these loaders (comma list)")
    ap.add_argument(
        "--ladder",
        default="all",
        help="ladder section: variants besides bare and f (comma list; all: every one)",
    )
    ap.add_argument("--lanes-seconds", type=float, default=2.0, help="lanes_bare: seconds per rate")
    ap.add_argument("--lanes-epochs", type=int, default=2, help="lanes_loader: epochs per rate")
    ap.add_argument(
        "--lanes-models", default="resnet18_112,resnet18_112_cpu2,resnet50_224", help="lanes_train"
    )
    ap.add_argument("--lanes-short-sweep", action="store_true", help="lanes_train: 3 fixed splits")
    ap.add_argument("--lanes-hw", action="store_true", help="lanes_train: the hardware lane too (opt-in)")
    ap.add_argument(
        "--lanes-auto-warm",
        type=int,
        default=128,
        help="lanes_train: untimed batches of the measured split first",
    )
    ap.add_argument("--lanes-sizes", default="128,256", help="lanes_loader: cache sizes")
    ap.add_argument("--lanes-sets", default="all", help="lanes_loader: lane sets (comma list)")
    ap.add_argument("--side-models", default="all", help="side_by_side: resnet50_224,resnet18_112 (or all)")
    ap.add_argument(
        "--side-loaders",
        default="default",
        help=f"side_by_side: dlstore rows: default ({','.join(SIDE_DEFAULT)}), all, or some of {','.join(SIDE_LOADERS)}",
    )
    ap.add_argument(
        "--side-alone-extra",
        default="",
        help="side_by_side: more dlstore rows for the loader-alone table only (comma list)",
    )
    ap.add_argument("--engines-parts", default="bare,costs,loader,train", help="engines: which parts")
    ap.add_argument("--engines-sets", default="all", help="engines loader: lane sets (comma list)")
    ap.add_argument(
        "--engines-variants", default="_copied", help="engines loader: _copied, _reads_after (comma list)"
    )
    ap.add_argument(
        "--engines-loader-fixed",
        default="",
        help="engines loader: fixed splits too, e.g. cpu0.4+nvjpeg0.6,cpu0.3+hw0.35+nvjpeg0.35",
    )
    ap.add_argument("--engines-repeats", type=int, default=1, help="engines loader: rotated rounds")
    ap.add_argument("--engines-r50-fixed", default="0.5,0.7,0.85,1.0", help="engines train: fixed hw shares")
    ap.add_argument(
        "--engines-mixed",
        default=None,
        help="engines loader without the bare part: the mixed decoder (ENGINES)",
    )
    args = ap.parse_args()
    work = harness.work_dir(args, "dlstore-jpeg-")
    RESULTS["environment"] = environment()
    RESULTS["protocol"] = {
        "images": args.images,
        "warmup": args.warmup,
        "steps": args.steps,
        "repeats": args.repeats,
        "order": "training configurations rotated per repeat; median",
    }
    names = harness.section_names(args.sections, SECTIONS)
    harness.run_sections(SECTIONS, names, args, work, RESULTS, TARGETS, "jpeg_cache.json")
    print(TARGETS.table(130))
    if isinstance(RESULTS.get("side_by_side"), dict) and "train" in RESULTS["side_by_side"]:
        print(side_tables(RESULTS["side_by_side"]))
    for r in (RESULTS.get("lanes_train") or {}).get("recommend", {}).values():
        print(f"recommended: {r['text']}\n    {r['code']}")


if __name__ == "__main__":
    main()
