"""Reading a raw cache, side by side in one run on one machine (meant for the lent H200): the loader
alone, chunked formats against a memmap, ResNet-18/50 and FashionMNIST's SmallCNN fed from a cache
against their synthetic ceilings.

    python benchmarks/fastpaths.py --out OUTDIR [--images 8192] [--sections all]

Writes OUTDIR/fastpaths.json (every number, the environment, the protocol) and OUTDIR/targets.json
({name, measured, ceiling_or_baseline, ratio, goal, met}), then prints a table. Each section is
independent and recorded as it finishes, so a failure or time-out loses only that section. The figures
of the sections this script had before (LitData/WebDataset, state keeping, fields) are in RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness  # noqa: E402

from dlstore import CachedDataset, convert, open_cache  # noqa: E402
from dlstore.gpu import GpuAugment  # noqa: E402
from dlstore.read import ChunkSampler  # noqa: E402

MEAN, STD = harness.MEAN, harness.STD
RESULTS: dict[str, Any] = {}
TARGETS = harness.Targets()
CORES = len(os.sched_getaffinity(0))
log, sync, target = harness.log, harness.sync, TARGETS.add
timed_steps, interleave, synthetic, make_loader = (
    harness.timed_steps,
    harness.interleave,
    harness.synthetic,
    harness.make_loader,
)


def smallcnn_step() -> Callable[[torch.Tensor, torch.Tensor], None]:
    """The seeds' FashionMNIST model (105,866 parameters), fp32, Adam."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = harness.small_cnn().cuda()
    assert sum(p.numel() for p in model.parameters()) == 105_866
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def augmented(loader: Any, aug: GpuAugment) -> Callable[[], Any]:
    def gen() -> Any:
        for x, y in loader:
            yield aug(x), y

    return gen


def workers_loader(path: Path, batch: int, workers: int, pin: bool = False) -> DataLoader:
    """``DataLoader(CachedDataset)`` as a user writes it: shuffled, batched reads (``__getitems__``)."""
    return DataLoader(
        CachedDataset(path),
        batch_size=batch,
        shuffle=True,
        num_workers=workers,
        pin_memory=pin,
        persistent_workers=workers > 0,
        prefetch_factor=4 if workers else None,
    )


# --- sections ----------------------------------------------------------------------------------------


def section_data(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"convert": {}}
    for fmt, size in (("ram", 256), ("npz", 256), ("zarr", 256), ("ram", 128)):
        res = harness.convert_cache(
            "demo", work / f"{fmt}{size}", format=fmt, size=size, workers=CORES, demo_images=args.images
        )
        out["convert"][f"{fmt}{size}"] = {"seconds": res.seconds, "img_s": res.images_per_s}
        log(f"convert {fmt}{size}: {res.images_per_s:,.0f} img/s")
    return out


def section_loader_alone(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    b = 256
    out: dict[str, Any] = {}
    cache = open_cache(work / "ram256", in_memory=True)
    n = len(cache)
    pinned = torch.empty((b, 256, 256, 3), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    rng = np.random.default_rng(0)

    def host_gather(threads: int) -> float:
        torch.set_num_threads(threads)
        idx = [rng.integers(0, n, b) for _ in range(200)]
        for i in idx[:10]:
            cache.read(i, out=pinned.numpy())
        t0 = time.perf_counter()
        for i in idx:
            cache.read(i, out=pinned.numpy())
        return len(idx) * b / (time.perf_counter() - t0)

    cores = CORES
    out["gather_1_thread"] = host_gather(1)
    out[f"gather_{cores}_threads"] = host_gather(cores)
    torch.set_num_threads(cores)

    def pinned_loader() -> float:
        loader = make_loader(cache, b)
        return timed_steps(lambda: iter(loader), lambda x, y: None, 10, 150, b)

    def workers(k: int, to_gpu: bool) -> Callable[[], float]:
        def run() -> float:
            loader = workers_loader(work / "ram256", b, k, pin=to_gpu)
            it = _Reiter(loader) if to_gpu else (lambda: iter(loader))
            return timed_steps(lambda: iter(it) if to_gpu else it(), lambda x, y: None, 20, 300, b)

        return run

    out["pinned_loader_to_gpu"] = interleave({"pinned": pinned_loader}, 2)["pinned"]
    out[f"dataloader_{cores}_workers_host"] = interleave({"w": workers(cores, False)}, 2)["w"]
    out[f"dataloader_{cores}_workers_to_gpu"] = interleave({"w": workers(cores, True)}, 1)["w"]
    resident = make_loader(cache, b, "resident")
    out["gpu_resident"] = timed_steps(lambda: iter(resident), lambda x, y: None, 10, 2000, b)
    one = max(out["gather_1_thread"], 0)
    best_one_process = max(out[f"gather_{cores}_threads"], out["pinned_loader_to_gpu"]["median"])
    target(
        "one-process reader, 256px RAM cache (gather into pinned / the loader to the GPU)",
        best_one_process,
        100_000,
        100_000,
        f"one thread: {one:,.0f} img/s",
    )
    target(
        f"loader alone, 256px RAM cache, {cores} DataLoader workers (host)",
        out[f"dataloader_{cores}_workers_host"]["median"],
        150_000,
        150_000,
        f"to GPU with pin_memory: {out[f'dataloader_{cores}_workers_to_gpu']['median']:,.0f} img/s",
    )
    target("loader alone, GPU-resident", out["gpu_resident"], 1_000_000, 1_000_000)
    return out


def section_random_reads(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    b = 256
    out: dict[str, Any] = {}
    memmap = open_cache(work / "ram256")
    buf = np.empty((b, 256, 256, 3), np.uint8)

    def rate(cache: Any, order: list[int], batches: int = 60) -> float:
        t0 = time.perf_counter()
        count = 0
        for i in range(0, min(len(order), batches * b) - b + 1, b):
            batch = np.asarray(order[i : i + b])
            # in storage order, as dlstore's loaders read a batch (a chunk's rows in one slice)
            cache.read(batch[np.argsort(cache.positions[batch], kind="stable")], out=buf)
            count += b
        return count / (time.perf_counter() - t0)

    for fmt in ("ram", "npz", "zarr"):  # warm page cache: this section compares decoding, not the disk
        for f in (work / f"{fmt}256").rglob("*"):
            if f.is_file():
                f.read_bytes()
    full = np.random.default_rng(1).permutation(len(memmap)).tolist()
    rate(memmap, full, batches=5)
    out["memmap_random"] = rate(memmap, full)
    for fmt in ("npz", "zarr"):
        cache = open_cache(work / f"{fmt}256")
        cache.reader.threads = CORES  # as PinnedLoader sets it: the one process decoding
        order = list(ChunkSampler(cache, seed=0))
        out[f"{fmt}_chunk_sampler"] = rate(cache, order)
        fresh = open_cache(work / f"{fmt}256")
        out[f"{fmt}_full_shuffle"] = rate(fresh, full, batches=10)
        target(
            f"{fmt} via ChunkSampler vs memmap, random order",
            out[f"{fmt}_chunk_sampler"],
            out["memmap_random"],
            0.5,
        )
    return out


def section_resnet(
    args: argparse.Namespace, work: Path, name: str, res: int, batch: int, cache_dir: str, goal: float
) -> dict[str, Any]:
    step = harness.model_step(name, 5)
    aug = GpuAugment(res, mean=MEAN, std=STD, out_dtype=torch.bfloat16, channels_last=True).cuda()
    cache = open_cache(work / cache_dir, in_memory=True)
    pinned = make_loader(cache, batch)
    resident = make_loader(cache, batch, "resident")
    graphed = make_loader(cache, batch, "resident", transform=aug, cuda_graph=True)
    dl2 = workers_loader(work / cache_dir, batch, 2)
    cfgs = {
        "synthetic": lambda: timed_steps(
            synthetic((batch, 3, res, res), 5), step, args.warmup, args.steps, batch
        ),
        "pinned_0_workers": lambda: timed_steps(augmented(pinned, aug), step, args.warmup, args.steps, batch),
        "dataloader_2_workers": lambda: timed_steps(
            augmented(_Reiter(dl2), aug), step, args.warmup, args.steps, batch
        ),
        "gpu_resident": lambda: timed_steps(augmented(resident, aug), step, args.warmup, args.steps, batch),
        "gpu_resident_graph": lambda: timed_steps(
            lambda: iter(graphed), step, args.warmup, args.steps, batch
        ),
    }
    out = interleave(cfgs, args.repeats)
    ceiling = out["synthetic"]["median"]
    best = max(("pinned_0_workers", "dataloader_2_workers"), key=lambda k: out[k]["median"])
    target(
        f"{name} bf16 @{res} bs{batch} from cache (<=2 workers: {best}) vs synthetic",
        out[best]["median"],
        ceiling,
        goal,
    )
    res_best = max(("gpu_resident", "gpu_resident_graph"), key=lambda k: out[k]["median"])
    target(f"{name} bf16 @{res} {res_best} vs synthetic", out[res_best]["median"], ceiling, goal)
    return out


class _Reiter:
    """A DataLoader as a fresh iterator each epoch, moving batches to the GPU."""

    def __init__(self, dl: Any) -> None:
        self.dl = dl

    def __iter__(self) -> Any:
        return ((x.cuda(non_blocking=True), y.cuda(non_blocking=True)) for x, y in self.dl)


def section_fashion(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    root = work / "fmnist"
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 60_000), ("t10k", 10_000)):  # the IDX files torchvision reads
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(
            np.array((0x803, n, 28, 28), ">i4").tobytes() + images.tobytes()
        )
        labels = (np.arange(n) % 10).astype(np.uint8)
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(
            np.array((0x801, n), ">i4").tobytes() + labels.tobytes()
        )
    convert(
        "torchvision:FashionMNIST",
        work / "fm28",
        root=root,
        format="ram",
        size=28,
        resize="stretch",
        channels=1,
    )
    step = smallcnn_step()
    cache = open_cache(work / "fm28", in_memory=True)
    resident = make_loader(cache, 256, "resident")
    aug = GpuAugment(
        28, scale=(0.75, 1.0), ratio=(1.0, 1.0), hflip_p=0.0, degrees=15, mean=(0.2860,), std=(0.3530,)
    ).cuda()
    pinned = make_loader(cache, 256)
    graphed = make_loader(cache, 256, "resident", transform=aug, cuda_graph=True)
    steps = args.steps * 3
    cfgs = {
        "synthetic": lambda: timed_steps(
            synthetic((256, 1, 28, 28), 10, torch.float32), step, 40, steps, 256
        ),
        "resident_gpu_augment": lambda: timed_steps(augmented(resident, aug), step, 40, steps, 256),
        "resident_light": lambda: timed_steps(
            lambda: ((x.float() / 255, y) for x, y in resident), step, 40, steps, 256
        ),
        "pinned_gpu_augment": lambda: timed_steps(augmented(pinned, aug), step, 40, steps, 256),
        "resident_gpu_augment_graph": lambda: timed_steps(lambda: iter(graphed), step, 40, steps, 256),
    }
    out = interleave(cfgs, args.repeats)
    best = max(("resident_gpu_augment", "resident_gpu_augment_graph"), key=lambda k: out[k]["median"])
    target(
        f"FashionMNIST SmallCNN + GPU augment, 0 workers ({best})",
        out[best]["median"],
        out["synthetic"]["median"],
        120_000,
        "goal is absolute img/s; baseline is the synthetic ceiling",
    )
    return out


SECTIONS: dict[str, harness.Section] = {
    "data": section_data,
    "loader": section_loader_alone,
    "random_reads": section_random_reads,
    "resnet50": lambda a, w: section_resnet(a, w, "resnet50", 224, 256, "ram256", 0.97),
    "resnet18": lambda a, w: section_resnet(a, w, "resnet18", 112, 512, "ram128", 0.90),
    "fashion": section_fashion,
}


def main() -> None:
    args = harness.parser(images=8192, warmup=30, steps=100, repeats=3).parse_args()
    work = harness.work_dir(args, "dlstore-fast-")
    RESULTS["environment"] = harness.environment()
    RESULTS["protocol"] = {
        "warmup": args.warmup,
        "steps": args.steps,
        "repeats": args.repeats,
        "images": args.images,
        "order": "configurations rotated per repeat; median, min-max",
    }
    names = harness.section_names(args.sections, SECTIONS)
    harness.run_sections(SECTIONS, names, args, work, RESULTS, TARGETS, "fastpaths.json")
    print(TARGETS.table(78))


if __name__ == "__main__":
    main()
