"""fp32 master weights: tiny updates that a half-precision model loses, kept.

    python examples/master_weights.py

A model whose weights are ~1 takes SGD steps of 1e-4, below fp16's resolution at 1.0 (2**-10). Lightning's
`16-true` (fp16 model, no masters) rounds every step away; `MixedPrecisionPlugin(master_weights=True)` keeps
an fp32 copy that the optimizer updates, and matches fp32 training.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import DynamicLossScaler, MixedPrecisionPlugin


class Scale(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(16))

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return (self.weight * x).sum().float()  # gradient = x = 1: each step moves the weights by lr

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-4)


def train(steps: int, **trainer_kwargs) -> float:
    model = Scale()
    loader = DataLoader(TensorDataset(torch.ones(steps, 16)), batch_size=1)
    L.Trainer(
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    ).fit(model, loader)
    return model.weight.float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    plugin = MixedPrecisionPlugin("16-mixed", scaler=DynamicLossScaler(init_scale=1024.0), master_weights=True)
    results = {
        "fp32 (32-true)": train(args.steps, precision="32-true"),
        "fp16 model, no masters (16-true)": train(args.steps, precision="16-true"),
        "fp16 model + fp32 masters (ours)": train(args.steps, plugins=[plugin]),
    }
    print(f"weight after {args.steps} steps of -1e-4 from 1.0 (expected {1 - args.steps * 1e-4:.4f}):")
    for name, value in results.items():
        print(f"  {name:36s} {value:.6f}")


if __name__ == "__main__":
    main()
