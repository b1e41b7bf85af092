"""Add MixedPrecisionPlugin to an existing LightningModule and train it.

    python examples/train_with_plugin.py                         # bf16 on CPU, fp16 on a GPU
    python examples/train_with_plugin.py --precision 16-mixed    # real fp16 (slow on most CPUs)
    python examples/train_with_plugin.py --max-epochs 1 --init-scale 1024 --growth-interval 50

A small MLP learns to classify points of two interleaved spirals (made up here, no download). At the end it
prints the held-out accuracy and what the loss scaler did.
"""

from __future__ import annotations

import argparse
import math

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import DynamicLossScaler, MixedPrecisionPlugin


def spirals(n: int, seed: int) -> TensorDataset:
    """Two interleaved spirals, ``n`` points each, with a little noise."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.rand(n, generator=gen) * 3 * math.pi + 0.5
    arm = torch.stack([t * torch.cos(t), t * torch.sin(t)], dim=1) / (3 * math.pi)
    x = torch.cat([arm, -arm]) + 0.02 * torch.randn(2 * n, 2, generator=gen)
    y = torch.cat([torch.zeros(n), torch.ones(n)]).long()
    return TensorDataset(x, y)


class SpiralClassifier(L.LightningModule):
    """An ordinary LightningModule: nothing in it knows about mixed precision."""

    def __init__(self, hidden: int = 256, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(2, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_acc", (self(x).argmax(dim=1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        steps = self.trainer.estimated_stepping_batches
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.hparams.lr, total_steps=steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = "16-mixed" if torch.cuda.is_available() else "bf16-mixed"
    parser.add_argument("--precision", choices=["16-mixed", "bf16-mixed"], default=default)
    parser.add_argument("--max-epochs", type=int, default=30)
    parser.add_argument("--init-scale", type=float, default=2.0**16, help="first loss scale (16-mixed only)")
    parser.add_argument("--growth-interval", type=int, default=2000, help="finite steps before the scale grows")
    parser.add_argument("--gradient-clip-val", type=float, default=1.0)
    args = parser.parse_args()

    L.seed_everything(0)
    scaler = None
    if args.precision == "16-mixed":
        scaler = DynamicLossScaler(init_scale=args.init_scale, growth_interval=args.growth_interval)
    plugin = MixedPrecisionPlugin(args.precision, scaler=scaler)
    trainer = L.Trainer(
        plugins=[plugin],
        max_epochs=args.max_epochs,
        gradient_clip_val=args.gradient_clip_val,
        logger=False,
        enable_checkpointing=False,
    )
    model = SpiralClassifier()
    train = DataLoader(spirals(1000, seed=1), batch_size=64, shuffle=True)
    val = DataLoader(spirals(250, seed=2), batch_size=500)
    trainer.fit(model, train, val)
    accuracy = trainer.callback_metrics["val_acc"].item()
    print(f"held-out accuracy: {accuracy:.3f}")
    if trainer.scaler is not None:
        print(
            f"loss scale: {trainer.scaler.scale:g} after {trainer.scaler.steps} optimizer steps, "
            f"{trainer.scaler.skipped_steps} skipped (non-finite gradients)"
        )


if __name__ == "__main__":
    main()
