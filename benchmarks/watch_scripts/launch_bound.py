"""SmallCNN fed whole batches made in advance (the loader costs next to nothing): the step's kernel
launches bind. The case for watch's own overhead, which shows most where a step is shortest."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from common import SmallCNN, device_of, parse, train
from torch.utils.data import DataLoader, Dataset


class Batches(Dataset):
    """``n // batch`` uint8 batches in one tensor; item i is batch i (a DataLoader with batch_size=None)."""

    def __init__(self, n: int, batch: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 255, (n // batch, batch, 1, 28, 28), dtype=torch.uint8, generator=g)
        self.y = torch.randint(0, 10, (n // batch, batch), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def build(args: Any) -> tuple[DataLoader, Callable[[torch.Tensor, torch.Tensor], None], torch.device]:
    """The loader, the step and the device (overhead_bisect.py's in-process alternation runs them too)."""
    device = device_of(args)
    loader = DataLoader(Batches(args.images, args.batch_size), batch_size=None, shuffle=True)
    model = SmallCNN().to(device)
    opt = torch.optim.Adam(model.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = torch.nn.functional.cross_entropy(model(x.float().div_(255)), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return loader, step, device


def main() -> None:
    args = parse(default_workers=0, default_batch=256, default_steps=1500)
    loader, step, device = build(args)
    train(loader, step, args, device)


if __name__ == "__main__":
    main()
