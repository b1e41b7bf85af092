"""2-rank fp8 checks (emulated on CPU, gloo), run by tests/test_fp8_distributed.py.

    python tests/distributed/fp8_checks.py OUT STRATEGY     (STRATEGY: ddp | fsdp2)

DDP: the plugin converts the layers on every rank (in place: DDP keeps the module), with and without master weights.
FSDP2: the user calls plugin.fp8_convert(self) then fully_shard in configure_model; the plugin turns on torchao's
fp8 all-gather and precomputes the weight scales after every optimizer step. Saved to OUT/rank<r>.pt.
"""

from __future__ import annotations

import functools
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_mp import MixedPrecisionPlugin, PrecisionMonitor
from tests.distributed.common import finish, save


class TrainsOnShards:
    """What the 2-rank fp8 nets share (a LightningModule mixin): each rank's half of 64 fixed samples in batches of
    8, cross-entropy recorded in ``self.losses``, AdamW."""

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(64, 32, generator=gen)
        dataset = TensorDataset(x, x[:, :16].argmax(1))
        sampler = DistributedSampler(dataset, self.trainer.world_size, self.global_rank, shuffle=False)
        return DataLoader(dataset, batch_size=8, sampler=sampler)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x).float(), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=2e-2)


class FP8Net(TrainsOnShards, L.LightningModule):
    def __init__(self, shard: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 16))
        self.shard = shard
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if not self.shard:
            return
        from torch.distributed.fsdp import fully_shard

        plugin = self.trainer.precision_plugin
        plugin.fp8_convert(self)  # before fully_shard: FSDP2 keeps the modules it shards
        mesh = self.device_mesh["data_parallel"]
        for index in (0, 2):
            fully_shard(self.net[index], mesh=mesh, mp_policy=plugin.fsdp2_policy())
        fully_shard(self.net, mesh=mesh, mp_policy=plugin.fsdp2_policy())


def _full(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)
    value = full() if full is not None else tensor
    inner = getattr(value, "_tensor", None)  # torchao's fp8 all-gather weight wrapper holds the plain tensor
    return (inner if isinstance(inner, torch.Tensor) else value).detach().float().clone()


def run(strategy_name: str, masters: bool) -> dict[str, Any]:
    from lightning.pytorch.strategies import ModelParallelStrategy

    shard = strategy_name == "fsdp2"
    strategy: Any = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if shard else "ddp"
    plugin = MixedPrecisionPlugin("bf16-mixed", fp8="tensorwise", master_weights=masters)
    model = FP8Net(shard)
    record: dict[str, Any] = {"gathers": [], "scales": []}
    if shard:
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

        original = WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather

        @functools.wraps(original)  # FSDP2 checks the hook's signature
        def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(self, *args, **kwargs)
            record["gathers"].append(str(out[0][0].dtype))
            return out

        WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather = spy
    monitor = PrecisionMonitor(sample_every=4, report=False)  # fp8 cast statistics, reduced over the ranks
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        plugins=[plugin],
        max_steps=8,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[monitor],
        enable_checkpointing=False,
        use_distributed_sampler=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model)
    if shard:
        WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather = original
        for index in (0, 2):
            weight = model.net[index].weight
            precomputed = weight._local_tensor._precomputed_scale
            amax = _full(weight).abs().max().double()
            record["scales"].append((float(precomputed), float(torch.finfo(torch.float8_e4m3fn).max / amax)))
    from torchao.float8.float8_linear import Float8Linear

    return {
        **record,
        "fp8_samples": monitor.history.fp8_samples,
        "losses": model.losses,
        "converted": plugin.fp8.converted,
        "config": repr(plugin.fp8.config),
        "float8_layers": [n for n, m in model.named_modules() if isinstance(m, Float8Linear)],
        "weights": {name: _full(p) for name, p in model.named_parameters()},
        "rank": trainer.global_rank,
    }


def main() -> None:
    out, strategy_name = Path(sys.argv[1]), sys.argv[2]
    results = {"masters": run(strategy_name, True), "no_masters": run(strategy_name, False)}
    save(results, out, results["masters"]["rank"])
    finish()


if __name__ == "__main__":
    main()
