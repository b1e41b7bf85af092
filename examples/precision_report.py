"""Where did fp16 go wrong? PrecisionMonitor on a run with the usual problems, and the report it writes.

    python examples/precision_report.py        # writes runs/precision_report/.../precision_report.{md,png}

A small MLP regresses a teacher's output from 32 features in fp16 (real fp16, on CPU too). The data has what real
data has: every 40th batch carries an unnormalised feature of about 1e5, beyond fp16's 65504. The scaler starts
too high (``init_scale=2**20``) and grows every 50 steps. PrecisionMonitor localises every skipped step (the first
steps: the loss scale; the outlier batches: the input layer's cast to fp16; after each growth: the loss scale
again), samples per-layer gradient statistics every 10 steps, and after fit writes the report, whose advice names
``fp32_modules: ["encoder.0"]`` and a lower ``init_scale``. The script prints the advice and where the files are.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import DynamicLossScaler, MixedPrecisionPlugin, PrecisionMonitor
from lightning_mp.diagnostics import advise


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
        self.head = nn.Linear(64, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.head(self.encoder(x)).float(), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def data(steps: int, batch: int = 32, outlier_every: int = 40) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(steps * batch, 32, generator=generator)
    teacher = torch.randn(32, 1, generator=generator) / 32**0.5
    y = torch.tanh(x @ teacher) * 1e-2  # small targets: small gradients
    for step in range(outlier_every - 1, steps, outlier_every):
        x[step * batch, 5] = 1e5  # an unnormalised feature in one sample of the batch
    return DataLoader(TensorDataset(x, y), batch_size=batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--root", default="runs/precision_report")
    parser.add_argument("--fp32-modules", nargs="*", default=[], help="apply the advice: e.g. --fp32-modules encoder.0")
    parser.add_argument("--init-scale", type=float, default=2.0**24)
    args = parser.parse_args()

    torch.manual_seed(0)
    scaler = DynamicLossScaler(init_scale=args.init_scale, growth_interval=50)
    plugin = MixedPrecisionPlugin(scaler=scaler, policy={"fp32_modules": args.fp32_modules})
    monitor = PrecisionMonitor(sample_every=10)  # the default samples every 100 steps, at least 5 times in a short run
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=args.steps,
        plugins=[plugin],
        callbacks=[monitor],
        default_root_dir=args.root,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=10,
    )
    trainer.fit(Regressor(), data(args.steps))
    history = monitor.history
    print(f"{history.steps} steps, {len(history.skipped)} skipped; final loss scale {scaler.scale:g}")
    for advice in advise(history):
        print(f"advice [{advice.rule}]: {advice.change}\n  evidence: {advice.evidence}")
    files = monitor.report_files  # precision_report_1.md, ... when the directory holds an earlier run's report
    print(f"report: {files.markdown} and {files.png.name if files.png else '(no figure)'}")


if __name__ == "__main__":
    main()
