"""2-rank DDP checks of ``optimizer_in_backward=True`` (run by tests/test_in_backward_ddp.py).

    python tests/distributed/ddp_in_backward_checks.py OUT

Lean masters under ``strategy="ddp"``, the updates in backward (``ours``) and the normal lean DDP step
(``reference``), AdamW, SGD, RMSprop (the generic path) and torchao's AdamW8bit (when installed), 4 steps; AdamW with one bucket per parameter, with
``gradient_as_bucket_view`` and in manual optimization;
then AdamW with a NaN loss on rank 1 only at step ``NAN_AT``, both ways; the refusals of reentrant checkpointing and
of a param group added during fit (before backward updates anything).
Each rank saves, per run, the checkpoint dictionary it would write (fp32 weights, optimizer state), the gradients
left after each step, DDP's communication hook and the scaler's skipped steps to OUT/rank<r>.pt.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader

from lightning_mp import MixedPrecisionPlugin, stepping
from tests.distributed.common import finish, save, sum_loader

NAN_AT = 2  # the step whose loss is NaN on rank 1 only
SMALL_BUCKETS_MB = 1e-4  # 100 bytes: one parameter per bucket


class Net(L.LightningModule):
    """Linear (bf16 + remainder: bf16 gradients) -> LayerNorm (kept fp32: fp32 gradients) -> GELU -> Linear."""

    def __init__(self, optimizer: str, nan_on_rank1: bool = False, manual: bool = False, variant: str = "") -> None:
        super().__init__()
        # "reentrant": the net under reentrant checkpointing; "partial": an optimizer over net.0-2 only while net.3
        # requires grad (DDP reduces it); "late_group": net.3 frozen at first, unfrozen and added at step 2
        self.variant = variant
        self.automatic_optimization = not manual
        width = 256 if optimizer == "adamw8bit" else 32  # AdamW8bit: net.0.weight's 4096 values take 8-bit moments
        self.net = nn.Sequential(nn.Linear(16, width), nn.LayerNorm(width), nn.GELU(), nn.Linear(width, 1))
        if variant == "late_group":  # frozen before DDP wraps the model (as BaseFinetuning freezes at setup)
            self.net[3].requires_grad_(False)
        self.optimizer_name, self.nan_on_rank1 = optimizer, nan_on_rank1
        self.grads_after_step: list[list[Any]] = []
        self.updated_in_backward: list[bool] = []
        self.comm_hooks: list[str] = []
        self.phase = 0  # "swap": SGD from step 2 (trainer.strategy.setup_optimizers, Lightning's way mid-fit)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.variant == "reentrant":
            out = checkpoint(self.net, x.clone().requires_grad_(), use_reentrant=True)
        else:
            out = self.net(x)
        loss = nn.functional.mse_loss(out.float(), y)
        if self.nan_on_rank1 and self.global_rank == 1 and self.trainer.global_step == NAN_AT:
            loss = loss * float("nan")
        if not self.automatic_optimization:  # the same step, as a manual loop writes it
            optimizer = self.optimizers()
            self.manual_backward(loss)  # the updates run here (on_after_backward sees them)
            optimizer.step()
            optimizer.zero_grad()
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.variant == "swap" and self.trainer.global_step == 2 and not self.phase:
            self.phase = 1
            self.trainer.strategy.setup_optimizers(self.trainer)
        if self.variant == "late_group" and self.trainer.global_step == 2:
            self.net[3].requires_grad_(True)
            self.trainer.optimizers[0].add_param_group({"params": list(self.net[3].parameters())})

    def on_train_start(self) -> None:
        hooks = getattr(self.trainer.strategy.model, "_comm_hooks", [])
        self.comm_hooks = [getattr(hook, "__name__", repr(hook)) for hook, _ in hooks]

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self.before = self.net[3].weight.detach().clone()

    def on_after_backward(self) -> None:  # whether backward itself changed the weights (the updates ran in it)
        self.updated_in_backward.append(not torch.equal(self.before, self.net[3].weight))

    def on_train_batch_end(self, *args: Any) -> None:
        self.grads_after_step.append([p.grad for p in self.parameters()])

    def train_dataloader(self) -> DataLoader:
        return sum_loader(self.trainer.world_size, self.global_rank)

    def configure_optimizers(self) -> Any:
        if self.phase:
            return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9, weight_decay=0.01)
        if self.variant in (
            "partial",
            "late_group",
        ):  # net.3 joins the optimizer at step 2 (in DDP's buckets from the start)
            return torch.optim.AdamW([p for layer in self.net[:3] for p in layer.parameters()], lr=1e-2)
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        if self.optimizer_name == "adamw8bit":  # torchao's: the one-pass 8-bit step (master/lean/eightbit.py)
            from torchao.optim import AdamW8bit

            return AdamW8bit(self.parameters(), lr=1e-2, weight_decay=0.1)
        if self.optimizer_name == "rmsprop":  # not AdamW/Adam/SGD: the generic path, on gloo's threads
            return torch.optim.RMSprop(self.parameters(), lr=1e-3, momentum=0.9, centered=True)
        return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01)


def run(
    in_backward: bool,
    optimizer: str,
    nan_on_rank1: bool = False,
    strategy: Any = "ddp",
    manual: bool = False,
    variant: str = "",
) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net(optimizer, nan_on_rank1, manual, variant)
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", optimizer_in_backward=in_backward)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        plugins=[plugin],
        max_steps=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
    )
    trainer.fit(model)
    checkpoint = trainer._checkpoint_connector.dump_checkpoint()  # what this rank would save
    return {
        "state_dict": checkpoint["state_dict"],
        "optimizer_state": checkpoint["optimizer_states"][0]["state"],
        "global_step": checkpoint["global_step"],
        "grads_after_step": [[g is None for g in step] for step in model.grads_after_step],
        "comm_hooks": model.comm_hooks,
        "updated_in_backward": model.updated_in_backward,
        "skipped_steps": plugin.scaler.skipped_steps,
    }


def main() -> None:
    out = Path(sys.argv[1])
    results = {}
    eight_bit = ("adamw8bit",) if importlib.util.find_spec("torchao") is not None else ()
    for optimizer in ("adamw", "sgd", "rmsprop", *eight_bit):
        results[f"ours_{optimizer}"] = run(True, optimizer)
        results[f"reference_{optimizer}"] = run(False, optimizer)
    # one bucket per parameter (DDP keeps the cap when it rebuilds its buckets), and gradients as bucket views
    results["ours_adamw_small_buckets"] = run(True, "adamw", strategy=DDPStrategy(bucket_cap_mb=SMALL_BUCKETS_MB))
    results["ours_adamw_bucket_views"] = run(True, "adamw", strategy=DDPStrategy(gradient_as_bucket_view=True))
    results["ours_adamw_manual"] = run(True, "adamw", manual=True)
    results["ours_swap"] = run(True, "adamw", variant="swap")  # AdamW, then SGD from step 2
    results["reference_swap"] = run(False, "adamw", variant="swap")
    results["ours_nan"] = run(True, "adamw", nan_on_rank1=True)
    results["reference_nan"] = run(False, "adamw", nan_on_rank1=True)
    stepping.DECIDE_CPU_FLAGS_ON_HOST = False  # the accelerators' path: the flags are not read at the step
    try:
        results["ours_nan_device_path"] = run(True, "adamw", nan_on_rank1=True)
    finally:
        stepping.DECIDE_CPU_FLAGS_ON_HOST = True
    try:  # refused at connect, before any step, on every rank
        run(True, "adamw", strategy=DDPStrategy(find_unused_parameters=True))
    except ValueError as error:
        results["find_unused_refusal"] = str(error)
    for variant in ("reentrant", "late_group", "partial"):  # refused in pre_backward (partial: at connect)
        try:
            run(True, "adamw", variant=variant)
        except (RuntimeError, ValueError) as error:
            results[f"{variant}_refusal"] = str(error)
    save(results, out, torch.distributed.get_rank())
    finish()


if __name__ == "__main__":
    main()
