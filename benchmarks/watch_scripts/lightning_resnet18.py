"""An ordinary Lightning training script (no dlstore inside): ResNet-18 on an ImageFolder with torchvision's
ImageNet transforms, one ``Trainer.fit``. ``--cpu`` (or no GPU) trains on the CPU in fp32.

    python lightning_resnet18.py DATA/train [--workers 4] [--batch-size 256] [--epochs 1] [--crop 224]
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F
import torchvision
from torchvision import datasets, transforms


class Classifier(L.LightningModule):
    def __init__(self, classes: int) -> None:
        super().__init__()
        self.net = torchvision.models.resnet18(num_classes=classes)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("data")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--crop", type=int, default=224)
    ap.add_argument("--cpu", action="store_true")
    a = ap.parse_args()
    augment = [transforms.RandomResizedCrop(a.crop), transforms.RandomHorizontalFlip(), transforms.ToTensor()]
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train = datasets.ImageFolder(a.data, transforms.Compose([*augment, normalize]))
    loader = torch.utils.data.DataLoader(
        train, batch_size=a.batch_size, shuffle=True, num_workers=a.workers, pin_memory=True, drop_last=True
    )
    gpu = torch.cuda.is_available() and not a.cpu
    trainer = L.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=1,
        precision="bf16-mixed" if gpu else "32-true",
        max_epochs=a.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Classifier(len(train.classes)), loader)


if __name__ == "__main__":
    main()
