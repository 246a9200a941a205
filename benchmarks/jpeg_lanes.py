"""Issue 27: every JPEG decode lane at once (CPU processes, the GPU's hardware engines through
nvImageCodec, nvJPEG on CUDA cores), alone and together, and the measured split against fixed ones.

    python benchmarks/jpeg_lanes.py --out OUTDIR [--images 4096] [--cpu-decoders 12] [--quick]

Photographs: random crops of scikit-image's bundled photos at ImageNet sizes (jpeg_cache.py's data),
converted to JPEG ``--resize shorter`` caches at 128 and 256 px. Sections, in one run:
- ``lanes``: each device lane bare (payloads read already, batches of 256), alone and both at once;
- ``loader``: ``DecodeLoader`` alone (no model) at 128 px (crop 112, batch 512) and 256 px (crop 224,
  batch 256) for each set of lanes, and the nvJPEG lane against a bare batched decode loop (alternated);
- ``train``: ResNet-18 @112 bs512 and ResNet-50 @224 bs256, bf16 channels-last, the measured split vs a
  sweep of fixed splits, and ResNet-18 with only 2 CPU decoders (CPU-starved);
- ``pixels``: the hardware lane's and nvJPEG's pixels vs Pillow's (mean abs, max).
Writes OUTDIR/jpeg_lanes.json and prints a table, with the split it recommends per model.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402
import jpeg_cache as jc  # noqa: E402

from dlstore import open_cache  # noqa: E402
from dlstore.read import DecodeLoader  # noqa: E402
from dlstore.read.hw_decode import HardwareJpeg  # noqa: E402

log, sync, DEV = harness.log, harness.sync, jc.DEV
OUT: dict[str, Any] = {}


def _save(out_dir: Path) -> None:
    (out_dir / "jpeg_lanes.json").write_text(json.dumps(OUT, indent=1, default=str))


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


def section_lanes(args: argparse.Namespace, work: Path, hw: HardwareJpeg | None) -> dict[str, Any]:
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
                    lambda i, lane=lane: lane.decode(views[i]), len(views), 256, args.seconds
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
    r = {name: _rate(fn, nb, 256, args.seconds) for name, fn in fns.items()}
    if hw is None:
        return r
    counts = [0, 0]
    stop = time.perf_counter() + args.seconds

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
    path: Path, batch: int, rrc: Any, lanes: list[str], cpu: int, split: dict | None = None
) -> DecodeLoader:
    return DecodeLoader(
        path,
        batch,
        transform=rrc,
        device=DEV,
        cpu_decoders=cpu if "cpu" in lanes else 0,
        lanes=lanes,
        split=split,
    )


def _lane_sets(hw: bool) -> dict[str, list[str]]:
    sets = {"nvjpeg": ["nvjpeg"], "cpu+nvjpeg": ["cpu", "nvjpeg"]}
    if hw:
        sets |= {"hw": ["hw"], "hw+nvjpeg": ["hw", "nvjpeg"], "cpu+hw+nvjpeg": ["cpu", "hw", "nvjpeg"]}
    return sets


def section_loader(args: argparse.Namespace, work: Path, hw: bool) -> dict[str, Any]:
    """DecodeLoader alone per set of lanes (measured split), and nvJPEG-only vs a bare decode loop."""
    out: dict[str, Any] = {}
    sizes = [int(v) for v in args.sizes.split(",")]
    for px, res, batch in [g for g in ((128, 112, 512), (256, 224, 256)) if g[0] in sizes]:
        path = work / f"jpeg_short{px}"
        from dlstore.gpu import RaggedRandomResizedCrop

        rrc = RaggedRandomResizedCrop(
            res, mean=jc.MEAN, std=jc.STD, out_dtype=torch.bfloat16, channels_last=True
        ).to(DEV)
        r: dict[str, Any] = {}
        for name, lanes in _lane_sets(hw).items():
            if args.lane_sets != "all" and name not in args.lane_sets.split(","):
                continue
            ld = _loader(path, batch, rrc, lanes, args.cpu_decoders)
            try:
                rate, _first = jc.loader_alone(ld, epochs=args.epochs)
                r[name] = {"img_s": rate, "shares": ld.split.shares(), "rerouted": ld.stats.rerouted}
            finally:
                ld.close()
            log(f"loader alone {px}px {name}: {rate:,.0f} img/s, shares {ld.split.shares()}")
        # the nvJPEG lane alone vs a bare batched decode_jpeg over the same cache and batch, alternated:
        # the loader decoding only (its batches handed over as lists) and decoding + its crop
        pair: dict[str, list[float]] = {"bare": [], "loader_decode_only": [], "loader_with_crop": []}
        for _ in range(args.repeats + 1):
            pair["bare"].append(jc.bare_rate(path, batch, passes=args.epochs))
            for key, tf in (("loader_decode_only", _as_list), ("loader_with_crop", rrc)):
                ld = _loader(path, batch, tf, ["nvjpeg"], 0)
                try:
                    pair[key].append(jc.loader_alone(ld, epochs=args.epochs)[0])
                finally:
                    ld.close()
        bare = float(np.median(pair["bare"]))
        r["nvjpeg_vs_bare"] = pair | {
            "decode_only_over_bare": float(np.median(pair["loader_decode_only"])) / bare,
            "with_crop_over_bare": float(np.median(pair["loader_with_crop"])) / bare,
        }
        log(f"loader {px}px nvJPEG vs bare: {r['nvjpeg_vs_bare']}")
        out[f"{px}px"] = r
    return out


def _as_list(images: list[torch.Tensor]) -> list[torch.Tensor]:
    return images


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
    step, synthetic, rrc = jc.training_setup(model, res, batch)
    lanes = ["cpu", "hw", "nvjpeg"] if hw else ["cpu", "nvjpeg"]
    loaders: dict[str, DecodeLoader] = {"auto": _loader(path, batch, rrc, lanes, cpu)}
    if gpu_only and not args.short_sweep:
        loaders["auto_gpu_lanes"] = _loader(path, batch, rrc, [n for n in lanes if n != "cpu"], 0)
        loaders["nvjpeg_only"] = _loader(path, batch, rrc, ["nvjpeg"], 0)
    if args.short_sweep:  # the two ends, and the measured split without the hardware lane
        loaders["auto_cpu_nvjpeg"] = _loader(path, batch, rrc, ["cpu", "nvjpeg"], cpu)
    short = (
        [{"cpu": 1.0}]
        + ([{"cpu": 0.5, "hw": 0.25, "nvjpeg": 0.25}] if hw else [])
        + [{"cpu": 0.5, "nvjpeg": 0.5}]
    )
    for split in _fixed_sweep(hw, True, coarse=model == "resnet50") if not args.short_sweep else short:
        name = "fixed_" + "_".join(f"{k}{v:.2f}" for k, v in split.items())
        loaders[name] = _loader(path, batch, rrc, lanes, cpu, split)
    cfgs: dict[str, Any] = {
        "synthetic": lambda: jc.timed_steps(synthetic, step, args.warmup, args.steps, batch)
    }
    for name, ld in loaders.items():
        cfgs[name] = lambda ld=ld: jc.timed_steps(lambda: iter(ld), step, args.warmup, args.steps, batch)
    runs: dict[str, list[float]] = {k: [] for k in cfgs}
    names = list(cfgs)
    try:
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
        "stats": {k: vars(ld.stats) for k, ld in loaders.items()},
    }
    log(
        f"train {model}@{res} cpu{cpu}: ceiling {ceiling:,.0f}; auto {med['auto']:,.0f} ({med['auto'] / ceiling:.3f}); best fixed {best} {fixed.get(best, 0):,.0f}; auto/best {out['auto_vs_best_fixed']}"
    )
    return out


def section_pixels(work: Path, hw: HardwareJpeg | None) -> dict[str, Any]:
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


def recommend(train: dict[str, Any]) -> dict[str, str]:
    """The lanes and split measured best per model (the fastest of the measured and fixed splits)."""
    out = {}
    for key, t in train.items():
        med = {k: v for k, v in t["median"].items() if k != "synthetic"}
        best = max(med, key=med.get)  # type: ignore[arg-type]
        out[key] = (
            f"{best}: {med[best]:,.0f} img/s ({t['of_ceiling'][best]:.3f} of the ceiling) with cpu_decoders={t['cpu_decoders']}, lanes {t['lanes']}"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--images", type=int, default=8192)
    ap.add_argument("--cpu-decoders", type=int, default=12)
    ap.add_argument("--seconds", type=float, default=2.0, help="each bare lane rate")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sections", default="lanes,loader,train,pixels")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a check, not figures")
    ap.add_argument("--models", default="resnet18_112,resnet18_112_cpu2,resnet50_224", help="train section")
    ap.add_argument("--short-sweep", action="store_true", help="train: only all-CPU as the fixed split")
    ap.add_argument("--sizes", default="128,256", help="loader section: cache sizes")
    ap.add_argument("--lane-sets", default="all", help="loader section: which lane sets (comma list)")
    args = ap.parse_args()
    if args.quick:
        args.images, args.seconds, args.epochs, args.warmup, args.steps, args.repeats = 1024, 0.3, 1, 2, 4, 1
    args.out.mkdir(parents=True, exist_ok=True)
    import tempfile

    work = args.work or Path(tempfile.mkdtemp(prefix="dlstore-lanes-"))
    t_start = time.perf_counter()
    OUT["environment"] = harness.environment()
    OUT["args"] = vars(args)
    ns = argparse.Namespace(images=args.images, caches="jpeg_short128,jpeg_short256")
    if not (work / "jpeg_short128").exists():
        OUT["data"] = jc.section_data(ns, work)
    hw = HardwareJpeg.open(torch.device(DEV)) if DEV == "cuda" else None
    OUT["hw_lane"] = hw is not None
    try:
        from nvidia import nvimgcodec

        OUT["nvimgcodec"] = nvimgcodec.__version__
    except Exception as e:
        OUT["nvimgcodec"] = f"absent: {e}"
    log(f"hardware lane: {OUT['hw_lane']} (nvimgcodec {OUT['nvimgcodec']})")
    sections = args.sections.split(",")
    steps = []
    if "pixels" in sections:
        steps.append(("pixels", lambda: section_pixels(work, hw)))
    if "lanes" in sections:
        steps.append(("lanes", lambda: section_lanes(args, work, hw)))
    if "train" in sections:
        c = args.cpu_decoders
        plan = {
            "resnet18_112": ("resnet18", 128, 112, 512, c),
            "resnet18_112_cpu2": ("resnet18", 128, 112, 512, 2),
            "resnet50_224": ("resnet50", 256, 224, 256, c),
        }
        models = args.models.split(",")
        steps.append(
            (
                "train",
                lambda: {
                    k: train_runs(args, work, *plan[k], hw is not None, not k.endswith("cpu2"))
                    for k in models
                },
            )
        )
    if "loader" in sections:
        steps.append(("loader", lambda: section_loader(args, work, hw is not None)))
    for name, fn in steps:
        t0 = time.perf_counter()
        try:
            OUT[name] = fn()
        except Exception as e:  # recorded; the other sections run on
            import traceback

            OUT[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            log(f"section {name} failed: {e}")
        OUT.setdefault("seconds", {})[name] = time.perf_counter() - t0
        _save(args.out)
    if isinstance(OUT.get("train"), dict) and "error" not in OUT["train"]:
        OUT["recommend"] = recommend(OUT["train"])
    OUT["total_s"] = time.perf_counter() - t_start
    _save(args.out)
    print(
        json.dumps(
            {k: OUT.get(k) for k in ("hw_lane", "nvimgcodec", "seconds", "recommend", "total_s")}, indent=1
        )
    )


if __name__ == "__main__":
    warnings.simplefilter("ignore", DeprecationWarning)
    main()
