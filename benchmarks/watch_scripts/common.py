"""Shared parts of the watch accuracy scripts: ordinary PyTorch, nothing from dlstore.

Each script takes ``--workers``, ``--steps``, ``--batch-size``; ``--hand PATH`` adds timing by hand (the
independent measurement: perf_counter around next(), what a user would add) and ``--replay K`` trains on K
of its own batches instead of the loader after the warm-up (an independent rate with data free)."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset


def parse(default_workers: int, default_batch: int, default_steps: int) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=default_workers)
    p.add_argument("--batch-size", type=int, default=default_batch)
    p.add_argument("--steps", type=int, default=default_steps)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--persistent", action="store_true")
    p.add_argument("--pin", action="store_true")
    p.add_argument("--hand", default=None, help="write hand-timed waits here (JSON)")
    p.add_argument("--replay", type=int, default=0, help="train on this many of its own batches (data free)")
    p.add_argument("--images", type=int, default=60_000)
    return p.parse_args()


class GreyImages(Dataset):
    """FashionMNIST-like: 28×28 grey uint8 images in one array, PIL + CPU transforms per sample."""

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

    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, 32, 3, padding=1),
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


def train(loader: Any, step: Callable[[torch.Tensor, torch.Tensor], None], args: argparse.Namespace) -> None:
    """The loop: ``args.steps`` steps over as many epochs as it takes; hand timing and replay on request."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    waits: list[float] = []
    kept: list[Any] = []
    done, t_start, replaying = 0, None, False
    while done < args.steps:
        it = iter(loader)
        while done < args.steps:
            t = time.perf_counter()
            if args.replay and len(kept) == args.replay:
                if not replaying:  # time the replayed steps only
                    replaying, waits = True, []
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    t_start = t = time.perf_counter()
                x, y = kept[done % args.replay]
            else:
                try:
                    x, y = next(it)
                except StopIteration:
                    break
                if args.replay and done >= args.warmup:
                    kept.append((x, y))
            if done == args.warmup and not replaying:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t_start = time.perf_counter()
            if done >= args.warmup:
                waits.append(time.perf_counter() - t)
            step(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
            done += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - (t_start or time.perf_counter())
    result = {
        "steps": len(waits),
        "wall_s": wall,
        "wait_s": sum(waits),
        "wait_share": sum(waits) / wall if wall > 0 else None,
        "img_per_s": args.batch_size * len(waits) / wall if wall > 0 else None,
        "replayed": replaying,
    }
    print(json.dumps({"script_result": result}))
    if args.hand:
        with open(args.hand, "w") as f:
            json.dump(result, f)
