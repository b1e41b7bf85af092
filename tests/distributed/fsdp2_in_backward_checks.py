"""2-rank FSDP2 checks of ``optimizer_in_backward=True`` (run by tests/test_in_backward_fsdp2.py).

    python tests/distributed/fsdp2_in_backward_checks.py OUT

Lean masters under ModelParallelStrategy + fully_shard (the norm on its own in fp32), the updates in backward
(``ours``) and the normal lean FSDP2 step (``reference``), AdamW, SGD and torchao's AdamW8bit (in one pass), 4 steps; AdamW with a NaN loss on rank 1
only at step ``BAD_AT``, both ways; AdamW with an inf written into rank 0's reduced gradient shard of ``net.0.weight``
at step ``BAD_AT`` (a hook that runs before the plugin's). Each rank saves, per run, the fp32 weights (full tensors),
its local shards of the optimizer state, the gradients left after each step, whether each step's backward changed
``net.0.weight``'s local shard, the skipped names and the scaler's skipped steps to OUT/rank<r>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader

from lightning_mp import MixedPrecisionPlugin, stepping
from lightning_mp.master.lean.chunked import local_of
from tests.distributed.common import _full, finish, save, sum_loader

BAD_AT = 2  # the step with a NaN loss on rank 1, or an inf in rank 0's gradient shard


class Net(L.LightningModule):
    """Linear (bf16 shard + remainder) -> LayerNorm (its own fp32 group) -> GELU -> Linear."""

    def __init__(self, optimizer: str, bad: str = "") -> None:
        super().__init__()
        width = 512 if optimizer == "adamw8bit" else 32  # AdamW8bit: net.0.weight's local shards take 8-bit moments
        self.net = nn.Sequential(nn.Linear(16, width), nn.LayerNorm(width), nn.GELU(), nn.Linear(width, 1))
        self.optimizer_name, self.bad = optimizer, bad
        self.grads_after_step: list[list[bool]] = []
        self.changed_in_backward: list[bool] = []
        self.skipped_names: list[list[str]] = []
        self.losses: list[float] = []
        self.step_kind: Optional[str] = None  # the lean store's step of the optimizer, if not the table's

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        plugin = self.trainer.precision_plugin
        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.net[1], mesh=mesh, mp_policy=plugin.fsdp2_policy("net.1", self.net[1]))
        fully_shard(self.net, mesh=mesh, mp_policy=plugin.fsdp2_policy())
        if self.bad == "inf_shard":  # registered before the plugin's: runs first, on the reduced shard
            self.net[0].weight.register_post_accumulate_grad_hook(self._inf_into_rank0_shard)

    def _inf_into_rank0_shard(self, param: torch.Tensor) -> None:
        if self.global_rank == 0 and self.trainer.global_step == BAD_AT:
            local_of(param.grad).view(-1)[0] = float("inf")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        if self.bad == "nan_loss" and self.global_rank == 1 and self.trainer.global_step == BAD_AT:
            loss = loss * float("nan")
        return loss

    def _sharded_weight(self) -> torch.Tensor:  # during forward and backward the module holds the unsharded one
        return local_of(self.trainer.optimizers[0].param_groups[0]["params"][0])

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self.before = self._sharded_weight().detach().clone()
        self.losses.append(loss.item())

    def on_after_backward(self) -> None:
        self.changed_in_backward.append(not torch.equal(self.before, self._sharded_weight()))

    def on_train_batch_end(self, *args: Any) -> None:
        self.grads_after_step.append([p.grad is None for p in self.parameters()])
        in_backward = self.trainer.precision_plugin.steps.in_backward
        self.skipped_names.append(list(in_backward.skipped_params) if in_backward is not None else [])
        update = self.trainer.precision_plugin.masters.updates.get(self.trainer.optimizers[0])
        self.step_kind = type(update.generic).__name__ if update is not None and update.generic is not None else None

    def train_dataloader(self) -> DataLoader:
        return sum_loader(self.trainer.world_size, self.global_rank)

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        if self.optimizer_name == "rmsprop":  # the generic path: refused under FSDP2 inside backward
            return torch.optim.RMSprop(self.parameters(), lr=1e-3)
        if self.optimizer_name == "adamw8bit":  # torchao's: in one pass on the local shards (fsdp2_eightbit.py)
            from torchao.optim import AdamW8bit

            return AdamW8bit(self.parameters(), lr=1e-2, weight_decay=0.1)
        return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01)


def run(in_backward: bool, optimizer: str, bad: str = "") -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net(optimizer, bad)
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", optimizer_in_backward=in_backward)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        plugins=[plugin],
        max_steps=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
    )
    trainer.fit(model)
    weights = {name: _full(value).cpu() for name, value in model.state_dict().items()}  # a collective per DTensor
    optimizer_ = trainer.optimizers[0]
    state = {  # (a tensor subclass, torchao's 8-bit state: as it is, the run is over)
        name: {key: _copy(local_of(value)) for key, value in optimizer_.state[param].items()}
        for name, param in model.named_parameters()
    }
    return {
        "weights": weights,
        "optimizer_state": state,
        "global_step": trainer.global_step,
        "grads_after_step": model.grads_after_step,
        "changed_in_backward": model.changed_in_backward,
        "skipped_names": model.skipped_names,
        "losses": model.losses,
        "skipped_steps": plugin.scaler.skipped_steps,
        "step_kind": model.step_kind,
    }


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone() if type(tensor) is torch.Tensor else tensor


def main() -> None:
    out = Path(sys.argv[1])
    results = {}
    for optimizer in ("adamw", "sgd", "adamw8bit"):
        results[f"ours_{optimizer}"] = run(True, optimizer)
        results[f"reference_{optimizer}"] = run(False, optimizer)
    results["ours_nan_loss"] = run(True, "adamw", "nan_loss")
    results["reference_nan_loss"] = run(False, "adamw", "nan_loss")
    results["ours_inf_shard"] = run(True, "adamw", "inf_shard")
    stepping.DECIDE_CPU_FLAGS_ON_HOST = False  # the accelerators' path: the flags are not read at the step
    try:
        results["ours_inf_shard_device_path"] = run(True, "adamw", "inf_shard")
    finally:
        stepping.DECIDE_CPU_FLAGS_ON_HOST = True
    try:  # refused at connect, before any step, on every rank
        run(True, "rmsprop")
    except ValueError as error:
        results["generic_refusal"] = str(error)
    save(results, out, torch.distributed.get_rank())
    finish()


if __name__ == "__main__":
    main()
