"""Shared parts of the watch accuracy scripts: ordinary PyTorch, nothing from dlstore (``--cache`` is the
one exception: it applies watch's cache recommendation, as a user would, and imports dlstore then).

Each script takes ``--workers``, ``--steps``, ``--batch-size``; ``--hand PATH`` writes what the script
timed by hand (perf_counter around next(): the independent wait measurement). ``--cpu`` (or
WATCH_SCRIPTS_CPU=1) runs on the CPU: the dry run with tiny sizes."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset


def parse(default_workers: int, default_batch: int, default_steps: int) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=default_workers)
    p.add_argument("--batch-size", type=int, default=default_batch)
    p.add_argument("--steps", type=int, default=default_steps, help="timed steps, after --warmup")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--persistent", action="store_true")
    p.add_argument("--pin", action="store_true")
    p.add_argument("--hand", default=None, help="write the hand timing here (JSON)")
    p.add_argument("--images", type=int, default=20_000)
    p.add_argument("--root", default=None, help="the ImageFolder (made here when missing)")
    p.add_argument("--cache", default=None, help="read this dlstore cache instead (watch's advice)")
    p.add_argument("--gpu-augment", action="store_true", help="with --cache: augment with GpuAugment")
    p.add_argument("--cpu", action="store_true", default=os.environ.get("WATCH_SCRIPTS_CPU") == "1")
    return p.parse_args()


def device_of(args: argparse.Namespace) -> torch.device:
    if args.cpu or not torch.cuda.is_available():
        torch.set_num_threads(1)  # the dry run on a small shared machine
        return torch.device("cpu")
    return torch.device("cuda")


def ensure_folder(root: str, n: int, side: int = 28, classes: int = 10) -> str:
    """A FashionMNIST-like ImageFolder: ``n`` grey ``side``-pixel PNGs in ``classes`` folders."""
    path = Path(root)
    if (path / ".complete").is_file():
        return root
    rng = np.random.default_rng(0)
    for c in range(classes):
        (path / f"class{c}").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        pixels = rng.integers(0, 255, (side, side), dtype=np.uint8)
        Image.fromarray(pixels).save(path / f"class{i % classes}" / f"{i:06d}.png")
    (path / ".complete").write_text(str(n))
    return root


class GreyImages(Dataset):
    """FashionMNIST-like in memory: uint8 images in one array, PIL + CPU transforms per sample."""

    def __init__(self, n: int, transform: Callable[[Any], Any], side: int = 28, channels: int = 1) -> None:
        rng = np.random.default_rng(0)
        shape = (n, side, side) if channels == 1 else (n, side, side, channels)
        self.data = rng.integers(0, 255, shape, dtype=np.uint8)
        self.targets = rng.integers(0, 10, n)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        return self.transform(Image.fromarray(self.data[i])), int(self.targets[i])


class SmallCNN(torch.nn.Module):
    """The seeds' FashionMNIST model (~105k parameters)."""

    def __init__(self, channels: int = 1) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(channels, 32, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(32, 64, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
        )
        self.head = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(64 * 7 * 7, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def train(
    loader: Any,
    step: Callable[[torch.Tensor, torch.Tensor], None],
    args: argparse.Namespace,
    device: torch.device,
) -> None:
    """``args.warmup`` steps, then ``args.steps`` timed ones (over as many epochs as it takes), each
    next() timed by hand."""
    waits: list[float] = []
    total = args.warmup + args.steps
    done, t_start, cpu_start = 0, 0.0, 0.0
    it = iter(loader)
    while done < total:
        if done == args.warmup:
            _sync(device)
            t_start = time.perf_counter()
            cpu_start = time.process_time()
        t = time.perf_counter()
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)  # a new epoch: its start (worker start-up) is the loop's cost too
            x, y = next(it)
        if done >= args.warmup:
            waits.append(time.perf_counter() - t)
        step(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
        done += 1
    _sync(device)
    wall = time.perf_counter() - t_start
    cpu = time.process_time() - cpu_start  # this process's CPU (all its threads) over the timed steps
    result: dict[str, Any] = {
        "steps": len(waits),
        "wall_s": wall,
        "wait_s": sum(waits),
        "wait_share": sum(waits) / wall,
        "img_per_s": args.batch_size * len(waits) / wall,
        "cpu_per_step_s": cpu / max(1, len(waits)),
        "steps_per_epoch": len(loader),
    }
    print(json.dumps({"script_result": result}), flush=True)
    if args.hand:
        Path(args.hand).write_text(json.dumps(result))
