"""Data-parallel training from a dlstore cache: one process per GPU, launched by torchrun.

    torchrun --standalone --nproc_per_node G benchmarks/ddp.py CACHE [--model resnet50] [--size 224]
        [--batch-size 256] [--epochs 2] [--order auto|chunk|random] [--checkpoint DIR [--resume EPOCH]]
        [--record DIR] [--compare-single --steps 60 --warmup 15 --out DIR]

Each rank reads its own share of every epoch through dlstore's fast loader (``num_replicas=G, rank=r``)
(``ChunkSampler`` for chunked caches, ``DistributedSampler`` for ``--order random``), augments on its
GPU (``GpuAugment``: RandomResizedCrop + flip, bf16, channels-last) and trains a DDP model. Every rank
gets the same number of samples (padded like ``DistributedSampler``), hence the same number of
steps: no rank waits forever in an all-reduce for one that ran out of data.

``--checkpoint DIR`` saves model and optimizer at each epoch boundary (rank 0, by rename, one file
per boundary); ``--resume E`` continues at epoch E from the file saved before it, and the sampler's order of that epoch is the one the
uninterrupted run had (it depends only on seed and epoch). ``--record DIR`` writes, per rank, the
indices of each epoch and what the loader delivered (tests/bench/test_ddp.py runs this on CPU with gloo).

``--compare-single`` measures, in the same launch and on the same cache, one GPU training alone
(rank 0, no DDP; the other ranks wait) and all G GPUs under DDP, alternating, and writes
``ddp.json`` under ``--out`` with the global images/s of each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

from dlstore.gpu import GpuAugment  # noqa: E402
from dlstore.read import Cache, open_cache  # noqa: E402

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
Step = Callable[[torch.Tensor, torch.Tensor], None]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cache", help="a dlstore cache (path or URL)")
    p.add_argument("--model", default="resnet50", help="smallcnn, resnet18, resnet50")
    p.add_argument("--size", type=int, default=224, help="crop size fed to the model")
    p.add_argument("--batch-size", type=int, default=256, help="per rank")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--order", default="auto", choices=["auto", "chunk", "random"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--in-memory", action="store_true", help="load a ram cache into each process")
    p.add_argument("--demo", type=int, default=0, help="first convert N demo images into CACHE (64 px zarr)")
    p.add_argument("--checkpoint", type=Path, help="save at each epoch boundary into this folder")
    p.add_argument("--resume", type=int, metavar="EPOCH", help="continue at EPOCH from --checkpoint")
    p.add_argument("--record", type=Path, help="write each rank's per-epoch indices here")
    p.add_argument("--compare-single", action="store_true", help="1 GPU vs all, same launch")
    p.add_argument("--steps", type=int, default=60, help="timed steps per phase (--compare-single)")
    p.add_argument("--warmup", type=int, default=15, help="untimed steps per phase (--compare-single)")
    p.add_argument("--repeats", type=int, default=2, help="alternations of the phases (--compare-single)")
    p.add_argument("--out", type=Path, help="folder for ddp.json (--compare-single)")
    return p.parse_args(argv)


# --- process group and model -------------------------------------------------------------------------


def init_distributed() -> tuple[int, int, torch.device]:
    """nccl on GPUs, gloo on CPU; torchrun's environment gives rank and world size."""
    cuda = torch.cuda.is_available()
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    return dist.get_rank(), dist.get_world_size(), device


def make_step(args: argparse.Namespace, cache: Cache, device: torch.device, ddp: bool) -> Step:
    """forward/backward/SGD, bf16 autocast on GPUs; with ``ddp`` the gradients are all-reduced."""
    torch.manual_seed(args.seed)  # the same initial weights on every rank and in every phase
    classes = len(cache.spec.classes)
    if args.model == "smallcnn":
        model: torch.nn.Module = harness.small_cnn(cache.spec.shape[2], args.size, classes)
    else:
        import torchvision

        model = getattr(torchvision.models, args.model)(num_classes=classes)
    model = model.to(device)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    net = (
        torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )
        if ddp
        else model
    )
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            loss = F.cross_entropy(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step.model, step.optimizer = model, opt  # type: ignore[attr-defined]
    return step


def make_augment(args: argparse.Namespace, device: torch.device, rank: int) -> GpuAugment:
    gen = torch.Generator(device).manual_seed(args.seed * 1000 + rank)  # different crops per rank
    cuda = device.type == "cuda"
    return GpuAugment(
        args.size,
        mean=MEAN,
        std=STD,
        out_dtype=torch.bfloat16 if cuda else torch.float32,
        channels_last=cuda,
        generator=gen,
    ).to(device)


def make_loader(args: argparse.Namespace, cache: Cache, device: torch.device, world: int, rank: int) -> Any:
    order = {"order": args.order, "seed": args.seed, "num_replicas": world, "rank": rank}
    return harness.make_loader(cache, args.batch_size, device=str(device), **order)


# --- training by epochs (checkpoint, resume, record) --------------------------------------------------


def checkpoint_file(folder: Path, next_epoch: int) -> Path:
    return folder / f"before-epoch-{next_epoch}.pt"


def save_checkpoint(folder: Path, step: Step, next_epoch: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    state = {
        "model": step.model.state_dict(),  # type: ignore[attr-defined]
        "optimizer": step.optimizer.state_dict(),  # type: ignore[attr-defined]
        "next_epoch": next_epoch,
    }
    final = checkpoint_file(folder, next_epoch)
    tmp = final.with_name(f".{final.name}.tmp{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, final)  # a kill mid-save never leaves a half-written checkpoint under its name


def load_checkpoint(folder: Path, epoch: int, step: Step, device: torch.device) -> int:
    state = torch.load(checkpoint_file(folder, epoch), map_location=device, weights_only=True)
    step.model.load_state_dict(state["model"])  # type: ignore[attr-defined]
    step.optimizer.load_state_dict(state["optimizer"])  # type: ignore[attr-defined]
    return int(state["next_epoch"])


def run_epoch(loader: Any, augment: GpuAugment, step: Step, epoch: int, cache: Cache) -> dict[str, Any]:
    """One epoch; returns what this rank was given and whether the loader delivered exactly that."""
    loader.set_epoch(epoch)
    indices = np.fromiter(iter(loader.sampler), dtype=np.int64)  # this rank's share of the epoch
    loader.set_epoch(epoch)  # listing it moved the sampler on to the next epoch
    batches = iter(loader)
    labels: list[np.ndarray] = []
    n_batches = 0
    for x, y in batches:
        step(augment(x), y)
        labels.append(y.cpu().numpy())
        n_batches += 1
    delivered = np.sort(np.concatenate(labels)) if labels else np.zeros(0, np.int64)
    expected = np.sort(cache.labels[indices[: n_batches * loader.batch_size]])
    return {
        "epoch": epoch,
        "indices": indices.tolist(),
        "batches": n_batches,
        "labels_match": bool(np.array_equal(delivered, expected)),
    }


def train(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> None:
    cache = open_cache(args.cache, in_memory=args.in_memory)
    step = make_step(args, cache, device, ddp=world > 1)
    augment = make_augment(args, device, rank)
    loader = make_loader(args, cache, device, world, rank)
    start = 0 if args.resume is None else load_checkpoint(args.checkpoint, args.resume, step, device)
    records = []
    for epoch in range(start, args.epochs):
        t0 = time.perf_counter()
        rec = run_epoch(loader, augment, step, epoch, cache)
        if rank == 0:
            print(
                f"epoch {epoch}: {rec['batches']} batches/rank, {time.perf_counter() - t0:.1f} s", flush=True
            )
        records.append(rec)
        if args.checkpoint is not None and rank == 0:
            save_checkpoint(args.checkpoint, step, epoch + 1)
        dist.barrier()  # the next epoch (or a resumed run) starts after the checkpoint exists
    if args.record is not None:
        args.record.mkdir(parents=True, exist_ok=True)
        doc = {"rank": rank, "world": world, "n": len(cache), "epochs": records}
        (args.record / f"rank{rank}.json").write_text(json.dumps(doc))


# --- 1 GPU vs G GPUs in one launch -------------------------------------------------------------------


def endless(loader: Any, augment: GpuAugment) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches across epoch boundaries (each a new sampler order), augmented on the device."""
    while True:
        for x, y in loader:
            yield augment(x), y


def timed(batches: Iterator[tuple[torch.Tensor, torch.Tensor]], step: Step, warmup: int, steps: int) -> float:
    """Seconds for ``steps`` steps after ``warmup``, synchronised before each clock read."""
    for _ in range(warmup):
        step(*next(batches))
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step(*next(batches))
    sync()
    return time.perf_counter() - t0


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def compare_single(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> None:
    torch.backends.cudnn.benchmark = True
    cache = open_cache(args.cache, in_memory=args.in_memory)
    augment = make_augment(args, device, rank)
    ddp_step = make_step(args, cache, device, ddp=True)
    ddp_batches = endless(make_loader(args, cache, device, world, rank), augment)
    single = None
    if rank == 0:
        single = (
            make_step(args, cache, device, ddp=False),
            endless(make_loader(args, cache, device, 1, 0), augment),
        )
    rates: dict[str, list[float]] = {"1gpu": [], f"{world}gpu": []}
    for _ in range(args.repeats):
        dist.barrier()
        if single is not None:  # the other ranks wait at the next barrier
            seconds = timed(single[1], single[0], args.warmup, args.steps)
            rates["1gpu"].append(args.steps * args.batch_size / seconds)
        dist.barrier()
        seconds = timed(ddp_batches, ddp_step, args.warmup, args.steps)
        slowest = torch.tensor([seconds], device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        rates[f"{world}gpu"].append(world * args.steps * args.batch_size / slowest.item())
    if rank == 0:
        report(args, cache, world, rates)


def report(args: argparse.Namespace, cache: Cache, world: int, rates: dict[str, list[float]]) -> None:
    one, many = float(np.median(rates["1gpu"])), float(np.median(rates[f"{world}gpu"]))
    doc = {
        "what": f"{args.model} bf16 @{args.size}, bs {args.batch_size}/GPU, dlstore's Loader (via pinned) from one cache, "
        f"1 GPU alone vs {world} GPUs under DDP, alternating in one launch",
        "cache": {"format": cache.spec.format, "n": len(cache), "shape": list(cache.spec.shape)},
        "args": {k: str(v) for k, v in vars(args).items()},
        "img_s": rates,
        "median_1gpu": one,
        f"median_{world}gpu": many,
        "speedup": many / one,
        "goal": 1.9 if world == 2 else 0.95 * world,
        "environment": {
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU, gloo)",
            "gpus": world,
            "cores": len(os.sched_getaffinity(0)),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
            "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
        },
    }
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "ddp.json").write_text(json.dumps(doc, indent=1))
    print(f"{'config':<10}{'img/s (median)':>16}  runs")
    print(f"{'1 GPU':<10}{one:>16,.0f}  {[round(r) for r in rates['1gpu']]}")
    print(f"{f'{world} GPUs':<10}{many:>16,.0f}  {[round(r) for r in rates[f'{world}gpu']]}")
    print(f"speedup {many / one:.3f}x (goal {doc['goal']}x)")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.resume is not None and args.checkpoint is None:
        raise SystemExit("--resume needs --checkpoint DIR")
    rank, world, device = init_distributed()
    if args.demo and rank == 0 and not Path(args.cache, "dlstore.json").is_file():
        import dlstore

        dlstore.convert(
            "demo", args.cache, dlstore.ConvertOptions(format="zarr", size=64, demo_images=args.demo)
        )
    dist.barrier()  # the cache is complete before any rank opens it
    try:
        if args.compare_single:
            compare_single(args, rank, world, device)
        else:
            train(args, rank, world, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
