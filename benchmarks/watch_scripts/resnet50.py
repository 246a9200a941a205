"""ResNet-50 bf16 channels_last at 224 px from in-memory uint8 images (light CPU work: ToTensor only):
compute-bound on one H200 with enough workers."""

from __future__ import annotations

import torch
import torchvision
import torchvision.transforms as T
from common import GreyImages, device_of, parse, train
from torch.utils.data import DataLoader


def main() -> None:
    args = parse(default_workers=8, default_batch=128, default_steps=150)
    device = device_of(args)
    ds = GreyImages(min(args.images, 2048), T.PILToTensor(), side=224, channels=3)
    loader = DataLoader(
        ds,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=args.workers,
        pin_memory=True,
        persistent_workers=args.workers > 0,
    )
    model = torchvision.models.resnet50().to(device, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        x = x.to(memory_format=torch.channels_last).float().div_(255)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    train(loader, step, args, device)


if __name__ == "__main__":
    main()
