"""SmallCNN whose loop reads loss.item() every step (a host-device synchronisation per step), 4 workers,
light CPU transform."""

from __future__ import annotations

import torch
import torchvision.transforms as T
from common import GreyImages, SmallCNN, device_of, parse, train
from torch.utils.data import DataLoader


def main() -> None:
    args = parse(default_workers=4, default_batch=256, default_steps=300)
    device = device_of(args)
    loader = DataLoader(
        GreyImages(args.images, T.ToTensor()),
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
    )
    model = SmallCNN().to(device)
    opt = torch.optim.Adam(model.parameters())
    losses = []

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())  # the synchronisation under test

    train(loader, step, args, device)


if __name__ == "__main__":
    main()
