"""SmallCNN on a FashionMNIST-like set, RandomResizedCrop + RandomRotation on the CPU (seeds 000/001).
Input-bound at 0 workers on a GPU; try --workers 4."""

from __future__ import annotations

import torch
import torchvision.transforms as T
from common import GreyImages, SmallCNN, parse, train
from torch.utils.data import DataLoader


def main() -> None:
    args = parse(default_workers=0, default_batch=256, default_steps=300)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tf = T.Compose([T.RandomResizedCrop(28, scale=(0.75, 1.0)), T.RandomRotation(15), T.ToTensor()])
    loader = DataLoader(
        GreyImages(args.images, tf),
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=args.workers,
        pin_memory=args.pin,
        persistent_workers=args.persistent and args.workers > 0,
    )
    model = SmallCNN().to(device)
    opt = torch.optim.Adam(model.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    train(loader, step, args)


if __name__ == "__main__":
    main()
