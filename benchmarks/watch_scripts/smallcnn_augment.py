"""SmallCNN on a FashionMNIST-like ImageFolder (28 px PNGs), RandomResizedCrop + RandomRotation on the CPU
(seeds 000/001). Input-bound at 0 workers on a GPU; try --workers 4. ``--cache DEST --gpu-augment``:
watch's cache advice applied (CachedDataset + GpuAugment, the only lines that import dlstore)."""

from __future__ import annotations

import torch
import torchvision.transforms as T
from common import SmallCNN, device_of, ensure_folder, parse, train
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder


def main() -> None:
    args = parse(default_workers=0, default_batch=256, default_steps=200)
    device = device_of(args)
    tf = T.Compose([T.RandomResizedCrop(28, scale=(0.75, 1.0)), T.RandomRotation(15), T.ToTensor()])
    augment = None
    if args.cache:
        import dlstore

        in_memory = dlstore.CachedDataset(args.cache).spec.format == "ram"
        if args.gpu_augment:
            from dlstore.gpu import GpuAugment

            ds = dlstore.CachedDataset(args.cache, in_memory=in_memory)
            augment = GpuAugment(28, scale=(0.75, 1.0), hflip_p=0.0, degrees=15).to(device)
        else:
            ds = dlstore.CachedDataset(args.cache, transform=tf, pil=True, in_memory=in_memory)
    else:
        ds = ImageFolder(ensure_folder(args.root or "/tmp/watch_fmnist_folder", args.images), transform=tf)
    loader = DataLoader(
        ds,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=args.workers,
        pin_memory=args.pin,
        persistent_workers=args.persistent and args.workers > 0,
    )
    model = SmallCNN(channels=3).to(device)
    opt = torch.optim.Adam(model.parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        if augment is not None:
            x = augment(x)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    train(loader, step, args, device)


if __name__ == "__main__":
    main()
