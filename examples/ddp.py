"""Train on several processes with MixedPrecisionPlugin: DDP or FSDP2, loss scaling, fp32 master weights.

    python examples/ddp.py                          # 2 CPU processes, DDP, bf16 model + fp32 master weights
    python examples/ddp.py --strategy fsdp2         # FSDP2: fully_shard with the plugin's policy (sharded masters)
    python examples/ddp.py --strategy fsdp2 --remainder  # lean masters: bf16 shards + 16-bit remainders
    python examples/ddp.py --precision 16-mixed     # fp16 + dynamic loss scaling (slow on CPUs: short run)
    python examples/ddp.py --accelerator cuda --devices 4 --precision 16-mixed

Lightning starts the other processes itself (this script is re-run for each rank). An MLP learns two interleaved
spirals (made up here, no download), with 2 micro-batches accumulated per optimizer step. Rank 0 prints the
held-out accuracy, what the loss scaler did (the same on every rank: the skip decision is agreed), and whether the
fp32 weights are bitwise identical on all ranks.
"""

from __future__ import annotations

import argparse
import math

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import DynamicLossScaler, MixedPrecisionPlugin


def spirals(n: int, seed: int) -> TensorDataset:
    """Two interleaved spirals, ``n`` points each, with a little noise."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.rand(n, generator=gen) * 3 * math.pi + 0.5
    arm = torch.stack([t * torch.cos(t), t * torch.sin(t)], dim=1) / (3 * math.pi)
    x = torch.cat([arm, -arm]) + 0.02 * torch.randn(2 * n, 2, generator=gen)
    return TensorDataset(x, torch.cat([torch.zeros(n), torch.ones(n)]).long())


class SpiralClassifier(L.LightningModule):
    """An ordinary LightningModule; ``shard=True`` applies FSDP2 in ``configure_model`` with the plugin's policy."""

    def __init__(self, hidden: int = 128, lr: float = 3e-3, shard: bool = False) -> None:
        super().__init__()
        self.shard = shard
        self.lr = lr
        self.net = nn.Sequential(
            nn.Linear(2, hidden),
            nn.LayerNorm(hidden),
            nn.GELU(),
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.Linear(hidden, 2),
        )

    def configure_model(self) -> None:
        if not self.shard:
            return
        from torch.distributed.fsdp import fully_shard

        plugin = self.trainer.precision_plugin
        mesh = self.device_mesh["data_parallel"]
        # what the plugin keeps in fp32 (the LayerNorm) is sharded on its own with an fp32 policy, then the rest
        fully_shard(self.net[1], mesh=mesh, mp_policy=plugin.fsdp2_policy("net.1", self.net[1]))
        fully_shard(self.net, mesh=mesh, mp_policy=plugin.fsdp2_policy())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x).float(), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(dim=1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def identical_on_all_ranks(module: nn.Module) -> bool:
    """Whether every rank holds bitwise the same fp32 weights (a collective: every rank calls it)."""
    flat = torch.cat([p.detach().float().flatten() for p in module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(gathered, flat)
    return all(torch.equal(flat, other) for other in gathered)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["ddp", "fsdp2"], default="ddp")
    parser.add_argument("--precision", choices=["16-mixed", "bf16-mixed"], default="bf16-mixed")
    parser.add_argument("--no-master-weights", action="store_true", help="keep an fp32 model (autocast only)")
    parser.add_argument(
        "--remainder", action="store_true", help="lean masters: bf16 weights + 16-bit remainders (bf16-mixed only)"
    )
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-epochs", type=int, default=10)
    args = parser.parse_args()

    L.seed_everything(0)
    scaler = DynamicLossScaler(init_scale=2.0**12, growth_interval=100) if args.precision == "16-mixed" else None
    masters = "remainder" if args.remainder else not args.no_master_weights
    plugin = MixedPrecisionPlugin(args.precision, scaler=scaler, master_weights=masters)
    fsdp2 = args.strategy == "fsdp2"
    strategy = ModelParallelStrategy(data_parallel_size=args.devices, tensor_parallel_size=1) if fsdp2 else "ddp"
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        plugins=[plugin],
        max_epochs=args.max_epochs,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = SpiralClassifier(shard=fsdp2)
    train = DataLoader(spirals(1000, seed=1), batch_size=32, shuffle=True)
    val = DataLoader(spirals(250, seed=2), batch_size=250)
    trainer.fit(model, train, val)

    same = None if fsdp2 else identical_on_all_ranks(model)  # FSDP2: each rank holds its own shard
    if trainer.global_rank == 0:
        print(f"{args.strategy} on {trainer.world_size} processes, {plugin!r}")
        print(f"held-out accuracy: {trainer.callback_metrics['val_acc'].item():.3f}")
        print(
            f"loss scale: {plugin.scaler.scale:g} after {plugin.scaler.steps} optimizer steps, "
            f"{plugin.scaler.skipped_steps} skipped"
        )
        if same is not None:
            print(f"fp32 weights bitwise identical on all {trainer.world_size} ranks: {same}")
    if torch.distributed.is_initialized():  # both ranks done, then the gloo threads end before the interpreter does
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    # rank 0 hosts the rendezvous store; exiting while the ranks it launched are still connected can abort it
    for child in getattr(getattr(trainer.strategy, "launcher", None), "procs", []):
        child.wait()


if __name__ == "__main__":
    main()
