"""Bytes per parameter held by each rank under DDP and FSDP2, with and without fp32 master weights.

    python -m torch.distributed.run --nproc_per_node 2 benchmarks/memory_distributed.py [--record]

Counted over the tensors each rank holds at ``on_before_optimizer_step`` of the second training step (gradients present,
after every reduction), for an MLP of ~1.1M parameters with AdamW: the parameters as the module holds them (half
with our masters, FSDP2's local fp32 shards), our fp32 masters, every gradient (model and masters), the optimizer
state, and DDP's own bucket buffers (``gradient_as_bucket_view=False``, Lightning's default; read from DDP's
logging data). Activations and FSDP2's transient all-gathered parameters are not counted (they do not stay between
steps). Rank 0 prints a Markdown table; ``--record`` appends it to benchmarks/HISTORY.md.
"""

from __future__ import annotations

import argparse
import datetime
import platform
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecisionPlugin

WIDTH = 512


class MLP(L.LightningModule):
    def __init__(self, shard: bool) -> None:
        super().__init__()
        self.shard = shard
        self.net = nn.Sequential(
            nn.Linear(WIDTH, WIDTH),
            nn.LayerNorm(WIDTH),
            nn.GELU(),
            nn.Linear(WIDTH, WIDTH),
            nn.GELU(),
            nn.Linear(WIDTH, WIDTH),
            nn.GELU(),
            nn.Linear(WIDTH, WIDTH),
            nn.GELU(),
            nn.Linear(WIDTH, 1),
        )
        self.counts: dict[str, int] = {}

    def configure_model(self) -> None:
        if self.shard:
            from torch.distributed.fsdp import fully_shard

            plugin = self.trainer.precision_plugin
            mesh = self.device_mesh["data_parallel"]
            fully_shard(self.net[1], mesh=mesh, mp_policy=plugin.fsdp2_policy("net.1", self.net[1]))
            fully_shard(self.net, mesh=mesh, mp_policy=plugin.fsdp2_policy())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.trainer.global_step == 1:  # the second step: AdamW's state exists from the first one
            self.counts = held_bytes(self, optimizer, self.trainer)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def _bytes(tensors: list[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for tensor in tensors:
        local = _local(tensor)
        key = local.untyped_storage().data_ptr()
        if key in seen:  # views of a buffer already counted (our masters are views of one flat buffer)
            continue
        seen.add(key)
        total += local.untyped_storage().nbytes()
    return total


def held_bytes(module: MLP, optimizer: Any, trainer: L.Trainer) -> dict[str, int]:
    seen: set[int] = set()
    plugin = trainer.precision_plugin
    params = list(module.parameters())
    counts = {"parameters": _bytes([p.detach() for p in params], seen)}
    masters = [flat for flat, _ in plugin.masters.flat_buffers] if plugin.masters is not None else []
    counts["masters"] = _bytes(masters, seen)
    optimizer_params = [p for group in optimizer.param_groups for p in group["params"]]
    counts["gradients"] = _bytes([p.grad for p in optimizer_params + params if p.grad is not None], seen)
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    counts["optimizer state"] = _bytes(state, seen)
    ddp = trainer.strategy.model if isinstance(trainer.strategy, DDPStrategy) else None
    buckets = 0
    if isinstance(ddp, nn.parallel.DistributedDataParallel):
        sizes = ddp._get_ddp_logging_data().get("bucket_sizes", "")
        buckets = sum(int(size) for size in str(sizes).split(", ") if size)
    counts["DDP buckets"] = buckets
    counts["numel"] = sum(p.numel() for p in params)  # global count (DTensor numel is the whole parameter)
    return counts


def run(strategy_name: str, masters: bool) -> dict[str, int]:
    torch.manual_seed(0)
    x = torch.randn(64, WIDTH)
    loader = DataLoader(TensorDataset(x, x[:, :1]), batch_size=16)
    strategy = (
        ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if strategy_name == "FSDP2" else "ddp"
    )
    model = MLP(shard=strategy_name == "FSDP2")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[MixedPrecisionPlugin("bf16-mixed", master_weights=masters)],
    )
    trainer.fit(model, loader)
    return model.counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help="append the table to benchmarks/HISTORY.md")
    args = parser.parse_args()
    columns = ["parameters", "masters", "gradients", "optimizer state", "DDP buckets"]
    rows = []
    for strategy_name in ("DDP", "FSDP2"):
        for masters in (False, True):
            counts = run(strategy_name, masters)
            per_param = {key: counts[key] / counts["numel"] for key in columns}
            label = f"{strategy_name}, bf16-mixed, " + ("master_weights=True" if masters else "fp32 model")
            cells = " | ".join(f"{per_param[key]:.2f}" for key in columns)
            rows.append(f"| {label} | {cells} | **{sum(per_param.values()):.2f}** |")
            numel = counts["numel"]
    if torch.distributed.get_rank() != 0:
        return
    header = (
        "| 2 ranks, AdamW: bytes per parameter on each rank | " + " | ".join(columns) + " | total |\n"
        "|---|" + "---:|" * (len(columns) + 1)
    )
    table = "\n".join([header, *rows])
    print(table)
    if args.record:
        now = datetime.datetime.now(datetime.timezone.utc)
        section = (
            f"\n### Memory per parameter under DDP and FSDP2 (2 CPU processes, MLP {numel / 1e6:.2f}M params)\n\n"
            f"- date: {now:%Y-%m-%d %H:%M} UTC; machine: cpu ({platform.machine()}, 2 ranks); "
            f"torch {torch.__version__}\n"
            "- command: `python -m torch.distributed.run --nproc_per_node 2 benchmarks/memory_distributed.py "
            "--record`\n\n" + table + "\n"
        )
        with (Path(__file__).parent / "HISTORY.md").open("a") as handle:
            handle.write(section)


if __name__ == "__main__":
    main()
