"""2-rank PrecisionMonitor checks (run by tests/test_diagnostics_distributed.py through tests/distributed/launch.py).

    python tests/distributed/monitor_checks.py OUT [ddp,fsdp2] [off,on]

For each strategy (DDP; FSDP2 = ModelParallelStrategy + fully_shard on a CPU mesh) and masters setting: an fp16 run
whose input is multiplied by 1e5 at step PLANT_AT, on rank 0 only and then on every rank (the first Linear's fp16
input overflows in the forward: the monitor replays it, in fp32 too), with a PrecisionMonitor, and the same run
without it. Each rank saves its skipped steps, overflow records, the report's text and the final weights to
OUT/<strategy>-<masters>/rank<r>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_mp import PrecisionMonitor
from lightning_mp.diagnostics.run_report import render_markdown
from tests.distributed.common import Net, finish, fit, save, shard_net

PLANT_AT = 2  # the optimizer step whose input overflows fp16


class PlantedNet(Net):
    """``Net`` whose input is multiplied by 1e5 at step PLANT_AT on the ranks in ``plant_ranks``."""

    plant_ranks: tuple[int, ...] = (0,)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.trainer.global_step == PLANT_AT and self.global_rank in self.plant_ranks:
            x = x * 1e5  # fp32 here; the Linear's fp16 cast overflows
        return torch.nn.functional.mse_loss(self.net(x).float(), y)


def run(strategy: str, masters: bool, plant_ranks: tuple[int, ...], monitor: bool) -> dict[str, Any]:
    PlantedNet.plant_ranks = plant_ranks
    watcher = PrecisionMonitor(sample_every=2, report=False) if monitor else None
    kwargs: dict[str, Any] = dict(inject=False, model_class=PlantedNet)
    if strategy == "fsdp2":
        kwargs.update(strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), shard=shard_net)
    if watcher is not None:
        kwargs["extra_callbacks"] = [watcher]
    result = fit("16-mixed", masters, **kwargs)
    if watcher is not None:
        result["skipped"] = list(watcher.history.skipped)
        result["overflows"] = [record.__dict__ for record in watcher.history.overflows]
        result["report"] = render_markdown(watcher.history, png_error="(not drawn)")
    return result


def main() -> None:
    out = Path(sys.argv[1])
    strategies = sys.argv[2].split(",") if len(sys.argv) > 2 else ["ddp", "fsdp2"]
    settings = sys.argv[3].split(",") if len(sys.argv) > 3 else ["off", "on"]
    for strategy in strategies:
        for setting in settings:
            results = {}
            for plant, ranks in (("one", (0,)), ("every", (0, 1))):
                results[plant] = run(strategy, setting == "on", ranks, monitor=True)
                results[f"{plant}_reference"] = run(strategy, setting == "on", ranks, monitor=False)
            save(results, out / f"{strategy}-{setting}", results["one"]["rank"])
    finish()


if __name__ == "__main__":
    main()
