"""Torch's DataLoader over a cache, and ``dlstore convert`` against what the cores can decode, side by side
in one run on one machine (meant for the lent H200).

    python benchmarks/slowpaths.py --out OUTDIR [--images 8192] [--sections all]

Sections (each recorded as it finishes, so a failure or time-out loses only that section):
  data          demo JPEGs and the 256 px ram cache the DataLoader section reads
  dataloader    all-thread memcpy; ``DataLoader(CachedDataset)`` at 0 and all-core workers, with and
                without pin_memory: img/s, MB/s and the main thread's CPU per batch
  convert       decode+resize on one core and alone in all-core processes at once; a ≥ 30 s all-core
                conversion (the demo files hard-linked many times) with ``ConvertResult.stages``
  convert_dask  with --convert-dask SCHED: the same long source through Dask, vs the pool's run

Writes OUTDIR/slowpaths.json (every number) and OUTDIR/targets.json, then prints the target table. The
figures of the sections this script had before (zarr codecs, py-spy profiles, the slot A/Bs, ResNet-18
from host memory: now ``fastpaths.py``) are in RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from dlstore import CachedDataset  # noqa: E402
from dlstore.datasets.demo import ensure_demo  # noqa: E402

RESULTS: dict[str, Any] = {}
TARGETS = harness.Targets()
LONG_SOURCE: dict[str, Any] = {}  # the long conversion's source and result, for convert_dask
CORES = len(os.sched_getaffinity(0))
log, target = harness.log, TARGETS.add


def section_data(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    demo = ensure_demo(work / "demo", n_images=args.images, workers=CORES)
    out: dict[str, Any] = {"demo_generate_s": time.perf_counter() - t0}
    res = harness.convert_cache(demo, work / "ram256", format="ram", size=256, workers=CORES)
    out["convert_ram256"] = {"seconds": res.seconds, "img_s": res.images_per_s, "stages": res.stages}
    log(f"convert ram256: {res.images_per_s:,.0f} img/s")
    return out


# --- DataLoader workers ------------------------------------------------------------------------------


def memcpy_rate(threads: int, nbytes: int = 1 << 30) -> float:
    """Bytes/s copied (each byte counted once) between two pre-faulted buffers, in ``threads`` threads."""
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    step = -(-nbytes // threads)
    parts = [slice(i, i + step) for i in range(0, nbytes, step)]
    best = 0.0
    with ThreadPoolExecutor(threads) as ex:
        for _ in range(3):
            t0 = time.perf_counter()
            list(ex.map(lambda s: np.copyto(dst[s], src[s]), parts))
            best = max(best, nbytes / (time.perf_counter() - t0))
    return best


def drain(loader: Any, warmup: int, batches: int) -> dict[str, float]:
    """img/s of a DataLoader after ``warmup`` batches, and the main thread's CPU ms per batch. Each batch
    is touched (one byte per 4 KiB page), as any consumer must: a batch in a freshly mapped shared-memory
    file pays its page faults then, not when it is handed over."""
    it = iter(loader)

    def nxt() -> Any:
        nonlocal it
        try:
            return next(it)
        except StopIteration:  # a new epoch (persistent workers carry on)
            it = iter(loader)
            return next(it)

    for _ in range(warmup):
        nxt()
    t0, thread0, n = time.perf_counter(), time.thread_time(), 0
    for _ in range(batches):
        x, _ = nxt()
        t = x.as_subclass(torch.Tensor)
        t.as_strided((t.numel() // 4096,), (4096,), t.storage_offset()).sum()
        n += len(x)
        del x, t  # released before the next is asked for, as in a training loop
    return {
        "img_s": n / (time.perf_counter() - t0),
        "main_thread_cpu_ms_per_batch": (time.thread_time() - thread0) * 1e3 / batches,
    }


def section_dataloader(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    b, k = 256, args.dl_workers or CORES
    out: dict[str, Any] = {"memcpy_bytes_s": memcpy_rate(k)}
    ds = CachedDataset(work / "ram256", in_memory=True)
    image_bytes = ds.spec.image_bytes
    # One shuffled pass over --dl-epoch-images draws (several permutations back to back) instead of one
    # epoch of len(ds): a small cache still gives epochs as long as a real dataset's (an epoch's end
    # drains workers x prefetch batches).
    draws = max(args.dl_epoch_images, len(ds))

    def plain(workers: int, pin: bool) -> Any:
        return torch.utils.data.DataLoader(
            ds,
            batch_size=b,
            sampler=torch.utils.data.RandomSampler(ds, num_samples=draws),
            num_workers=workers,
            pin_memory=pin,
            drop_last=True,
            persistent_workers=workers > 0,
        )

    configs = {"w0": (0, False), "w0_pin": (0, True), f"w{k}": (k, False), f"w{k}_pin": (k, True)}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    names = list(configs)
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            workers, pin = configs[name]
            loader = plain(workers, pin)
            runs[name].append(drain(loader, args.dl_warmup if workers else 3, args.loader_batches))
            del loader
            log(f"  {name}: {runs[name][-1]['img_s']:,.0f} img/s")
    for name, rs in runs.items():
        med = float(np.median([r["img_s"] for r in rs]))
        cpu = float(np.median([r["main_thread_cpu_ms_per_batch"] for r in rs]))
        out[name] = {"median_img_s": med, "median_bytes_s": med * image_bytes, "main_ms": cpu, "runs": rs}
    mc = out["memcpy_bytes_s"]
    for name, label, goal in ((f"w{k}", "", 0.4), (f"w{k}_pin", ", pin_memory", 0.3)):
        target(
            f"DataLoader(CachedDataset, shuffle), {k} workers{label}, MB/s vs {k}-thread memcpy",
            out[name]["median_bytes_s"] / 1e6,
            mc / 1e6,
            goal,
            f"{out[name]['median_img_s']:,.0f} img/s of {image_bytes:,} B; main thread "
            f"{out[name]['main_ms']:.2f} ms/batch",
        )
    target(
        "DataLoader(CachedDataset, shuffle), 0 workers, img/s",
        out["w0"]["median_img_s"],
        25_000,
        25_000,
        f"with pin_memory {out['w0_pin']['median_img_s']:,.0f} img/s",
    )
    return out


# --- convert -----------------------------------------------------------------------------------------


def decode_resize(path: Path) -> np.ndarray:
    """What ``convert --size 256`` does to one file: decode, shorter side to 256, centre crop."""
    with Image.open(path) as img:
        img = img.convert("RGB")
        w, h = img.size
        scale = 256 / min(w, h)
        img = img.resize((max(256, round(w * scale)), max(256, round(h * scale))), Image.BILINEAR)
        left, top = (img.width - 256) // 2, (img.height - 256) // 2
        return np.asarray(img.crop((left, top, left + 256, top + 256)))


def one_core_rate(files: list[Path], n: int, rounds: int = 3) -> float:
    """Decode+resize img/s on one core over images drawn from the whole source (median of rounds)."""
    for f in files[:30]:
        decode_resize(f)
    rng = np.random.default_rng(0)
    rates = []
    for _ in range(rounds):
        idx = rng.choice(len(files), size=min(n, len(files)), replace=False)
        t0 = time.perf_counter()
        for i in idx:
            decode_resize(files[i])
        rates.append(len(idx) / (time.perf_counter() - t0))
    return float(np.median(rates))


def linked_source(demo: Path, dest: Path, copies: int) -> Path:
    """A folder of ``copies`` hard links to every demo image (new names, same classes): a large source
    without generating more images."""
    if dest.exists():
        shutil.rmtree(dest)
    for cls in sorted(p for p in demo.iterdir() if p.is_dir()):
        (dest / cls.name).mkdir(parents=True)
        files = sorted(f for f in cls.iterdir() if f.is_file())
        for c in range(copies):
            for f in files:
                os.link(f, dest / cls.name / f"{c:03d}_{f.name}")
    return dest


def section_convert(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    demo = ensure_demo(work / "demo", n_images=args.images, workers=CORES)
    files = sorted(demo.rglob("*.jpg"))
    one = one_core_rate(files, args.one_core_images)
    alone = harness.all_cores_rate(lambda i: decode_resize(files[i]), len(files), CORES, args.one_core_images)
    out: dict[str, Any] = {"one_core_img_s": one, "cores": CORES, "decode_alone_all_cores": alone}
    log(f"  decode+resize: one core {one:,.0f} img/s, alone in {CORES} processes {alone['img_s']:,.0f}")
    image_bytes = 256 * 256 * 3
    want = int(args.convert_seconds * CORES * one)
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and shutil.disk_usage(shm).free > 1.3 * want * image_bytes else work
    n = min(want, int(0.75 * shutil.disk_usage(base).free / image_bytes))
    long_src = linked_source(demo, work / "long_src", max(1, -(-n // len(files))))
    dest = base / "dlstore_long_ram256"
    try:
        res = harness.convert_cache(long_src, dest, format="ram", size=256, workers=CORES, overwrite=True)
    finally:
        shutil.rmtree(dest, ignore_errors=True)
    st = res.stages
    fixed = sum(st.get(k, 0) for k in ("setup_s", "startup_s", "finalize_s", "commit_s"))
    out.update(
        dest_filesystem=str(base), images=res.n, seconds=res.seconds, img_s=res.images_per_s, stages=st
    )
    log(f"  convert long: {res.n} images in {res.seconds:.1f} s = {res.images_per_s:,.0f} img/s; stages {st}")
    label = f"convert (ram, 256px, {CORES} workers, {res.seconds:.0f} s run)"
    note = f"{res.n:,} images to {base}; fixed costs {fixed:.1f} s"
    target(f"{label} vs cores x one-core decode+resize", res.images_per_s, CORES * one, 0.85, note)
    target(
        f"{label} vs decode+resize alone in {CORES} processes", res.images_per_s, alone["img_s"], 0.85, note
    )
    if args.convert_dask:  # the convert_dask section converts the same source next
        LONG_SOURCE.update(src=long_src, base=base, pool=res)
    else:
        shutil.rmtree(long_src, ignore_errors=True)
    return out


def section_convert_dask(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The convert section's long source again through ``--scheduler`` (a local cluster's start included),
    against the built-in pool's run just before on the same files: the goal is 0.9x the pool."""
    if not args.convert_dask or not LONG_SOURCE:
        return {"skipped": "needs --convert-dask and the convert section before it"}
    pool, dest = LONG_SOURCE["pool"], LONG_SOURCE["base"] / "dlstore_long_ram256_dask"
    try:
        res = harness.convert_cache(
            LONG_SOURCE["src"], dest, format="ram", size=256, scheduler=args.convert_dask, overwrite=True
        )
    finally:
        shutil.rmtree(dest, ignore_errors=True)
        shutil.rmtree(LONG_SOURCE["src"], ignore_errors=True)
    st = res.stages
    target(
        f"Dask convert (--scheduler {args.convert_dask}, cluster start included) vs the built-in pool, same "
        f"{res.n:,} images",
        res.images_per_s,
        pool.images_per_s,
        0.9,
        f"pool {pool.seconds:.1f} s then Dask {res.seconds:.1f} s; Dask start-up {st.get('startup_s', 0):.2f} s",
    )
    return {"scheduler": args.convert_dask, "images": res.n, "seconds": res.seconds, "stages": st}


SECTIONS: dict[str, harness.Section] = {
    "data": section_data,
    "dataloader": section_dataloader,
    "convert": section_convert,
    "convert_dask": section_convert_dask,
}


def main() -> None:
    ap = harness.parser(images=8192, warmup=30, steps=100, repeats=2)
    ap.add_argument("--loader-batches", type=int, default=120)
    ap.add_argument("--convert-seconds", type=float, default=32.0, help="aimed length of the long conversion")
    ap.add_argument("--one-core-images", type=int, default=250, help="convert: images per one-core round")
    ap.add_argument("--convert-dask", default="", help="convert: also the long source with this --scheduler")
    ap.add_argument("--dl-warmup", type=int, default=8, help="DataLoader batches before timing (workers)")
    ap.add_argument("--dl-workers", type=int, default=0, help="DataLoader workers (default: all cores)")
    ap.add_argument("--dl-epoch-images", type=int, default=0, help="DataLoader draws per epoch (default: n)")
    args = ap.parse_args()
    work = harness.work_dir(args, "dlstore-slow-")
    RESULTS["environment"] = harness.environment()
    RESULTS["protocol"] = {k: v for k, v in vars(args).items() if k not in ("out", "work")}
    names = harness.section_names(args.sections, SECTIONS)
    try:
        harness.run_sections(SECTIONS, names, args, work, RESULTS, TARGETS, "slowpaths.json")
    finally:
        if LONG_SOURCE:
            shutil.rmtree(LONG_SOURCE["src"], ignore_errors=True)
    print(TARGETS.table(96))


if __name__ == "__main__":
    main()
