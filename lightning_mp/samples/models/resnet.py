"""``ResNetClassifier``: ResNet-18 (and smaller depths) for small images, in plain torch (no torchvision)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

#: BasicBlocks per stage for each depth (He et al., 2016); 10 and 14 are the usual smaller variants.
STAGES = {10: (1, 1, 1, 1), 14: (2, 2, 1, 1), 18: (2, 2, 2, 2), 34: (3, 4, 6, 3)}


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual connection (1x1 projection when the shape changes)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """ResNet with a small-image stem (``stem="small"``: one 3x3 convolution, stride 1, no max-pool; for 28x28 or
    8x8 inputs) or the ImageNet stem (``stem="imagenet"``: 7x7 convolution with stride 2, then a 3x3 max-pool
    with stride 2, as in He et al. and torchvision; for 224x224 inputs)."""

    def __init__(
        self, depth: int = 18, num_classes: int = 10, in_channels: int = 1, width: int = 64, stem: str = "small"
    ) -> None:
        super().__init__()
        if depth not in STAGES:
            raise ValueError(f"depth={depth!r} is not supported: use one of {sorted(STAGES)}.")
        if stem == "small":
            layers = [nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
        elif stem == "imagenet":
            layers = [
                nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(),
                nn.MaxPool2d(3, stride=2, padding=1),
            ]
        else:
            raise ValueError(f"stem={stem!r} is not supported: use 'small' or 'imagenet'.")
        self.stem = nn.Sequential(*layers)
        blocks, channels = [], width
        for stage, count in enumerate(STAGES[depth]):
            out_channels = width * 2**stage
            for index in range(count):
                blocks.append(BasicBlock(channels, out_channels, stride=2 if stage > 0 and index == 0 else 1))
                channels = out_channels
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.blocks(self.stem(x))
        return self.head(features.mean(dim=(2, 3)))


class ResNetClassifier(L.LightningModule):
    """Image classification with :class:`ResNet`, SGD with momentum and a cosine learning-rate schedule.

    Args:
        depth: 10, 14, 18 (default) or 34.
        num_classes: output classes (default 10).
        in_channels: input channels (default 1: grayscale digits, MNIST, Fashion-MNIST).
        width: channels of the first stage, doubled at each of the 4 stages (default 64, as ResNet-18).
        stem: ``"small"`` (default: 3x3 convolution, no downsampling; 8x8 or 28x28 images) or ``"imagenet"``
            (7x7 stride-2 convolution and max-pool; 224x224 images).
        lr: peak SGD learning rate (default 0.05).
        momentum: SGD momentum (default 0.9).
        weight_decay: SGD weight decay (default 5e-4).
    """

    def __init__(
        self,
        depth: int = 18,
        num_classes: int = 10,
        in_channels: int = 1,
        width: int = 64,
        stem: str = "small",
        lr: float = 0.05,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = ResNet(depth, num_classes, in_channels, width, stem)
        self.val_acc = MulticlassAccuracy(num_classes)
        self.test_acc = MulticlassAccuracy(num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = nn.functional.cross_entropy(self(images).float(), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_acc)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_acc)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(images).argmax(dim=-1)

    def _evaluate(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str, acc: MulticlassAccuracy) -> None:
        images, labels = batch
        logits = self(images)
        acc(logits.argmax(dim=-1), labels)
        # sync_dist: under DDP the epoch's loss is the mean over every rank's shard, not rank 0's (the accuracy, a
        # torchmetrics metric, syncs itself)
        self.log(f"{stage}_loss", nn.functional.cross_entropy(logits.float(), labels), sync_dist=True)
        self.log(f"{stage}_acc", acc, prog_bar=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(
            self.parameters(),
            lr=self.hparams["lr"],
            momentum=self.hparams["momentum"],
            weight_decay=self.hparams["weight_decay"],
        )
        total = max(1, int(self.trainer.estimated_stepping_batches))
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
