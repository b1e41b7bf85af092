"""2-rank Fabric checks (gloo on CPU), run by tests/test_fabric_distributed.py.

    python tests/distributed/fabric_checks.py OUT

In each process: the Trainer runs of ``common.fit`` (DDP and FSDP2) and a Fabric loop written as users write it with
the same model, data, plugin settings and clipping, in the same process group; a Fabric run with an inf in rank 0's
batch at step INJECT_AT; a Fabric run interrupted after epoch 0, saved with ``fabric.save``, rebuilt, loaded with
``fabric.load`` and finished. FSDP2 with lean masters also runs torchao's ``AdamW8bit`` (on ``WideNet``'s layers,
whose 64x128 weight has a 64x64 local shard: 8-bit state), and its refusal of a single-file checkpoint. Each rank
saves what it saw to OUT/rank<r>.pt.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from lightning_mp.diagnostics import FabricPrecisionMonitor
from lightning_mp.master.lean.chunked import local_of
from tests.distributed.common import (
    CLIP,
    EPOCHS,
    GLOBAL_BATCH,
    INJECT_AT,
    _full,
    finish,
    fit,
    loader,
    make_plugin,
    save,
    shard_net,
)

#: name -> (precision, master_weights, accumulate, FSDP2, reduce_dtype, optimizer); "adamw8bit": torchao's AdamW8bit
#: on WideNet's layers (``tests/distributed/fsdp2_lean_checks.py``'s ``Wide8bit``), "sgd": SGD on Net's
RUNS = {
    "remainder": ("bf16-mixed", "remainder", 1, False, "float32", "sgd"),
    "remainder_acc2": ("bf16-mixed", "remainder", 2, False, "float32", "sgd"),
    "masters_acc2": ("bf16-mixed", True, 2, False, "float32", "sgd"),
    "masters_bf16_reduce": ("bf16-mixed", True, 1, False, "bf16", "sgd"),
    "remainder_bf16_reduce": ("bf16-mixed", "remainder", 2, False, "bf16", "sgd"),
    "fp16": ("16-mixed", False, 1, False, "float32", "sgd"),
    "fsdp2_masters": ("bf16-mixed", True, 1, True, "float32", "sgd"),
    "fsdp2_remainder": ("bf16-mixed", "remainder", 1, True, "float32", "sgd"),
    "fsdp2_remainder_8bit": ("bf16-mixed", "remainder", 1, True, "float32", "adamw8bit"),
}


def _shard(module: nn.Module, mesh: Any, plugin: Any) -> nn.Module:
    """The user's parallelize_fn: the norm on its own with its policy, then the network (as ``shard_net``)."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(module[1], mesh=mesh["data_parallel"], mp_policy=plugin.fsdp2_policy("1", module[1]))
    fully_shard(module, mesh=mesh["data_parallel"], mp_policy=plugin.fsdp2_policy())
    return module


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adamw8bit":  # Wide8bit's
        from torchao.optim import AdamW8bit

        return AdamW8bit(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _net(optimizer_name: str) -> nn.Sequential:
    """Net's layers (seed 0); for "adamw8bit" WideNet's, made after Net's as the Trainer's Wide8bit makes them (the
    same initial values): its 64x128 weight has 4096 values per rank, so torchao quantises its state."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 1))
    if optimizer_name == "adamw8bit":
        net = nn.Sequential(
            nn.Linear(4, 64), nn.LayerNorm(64), nn.Tanh(), nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 1)
        )
    return net


def eightbit_kinds(plugin: Any, optimizer: torch.optim.Optimizer, weight: torch.Tensor) -> dict[str, Any]:
    """Which step the lean store runs ``optimizer`` with (``ShardedAdam8bitStep``: torchao's 8-bit Adam in one pass on
    the local shards), and the kinds of ``weight``'s moments: (wrapper, local shard), ``("DTensor", "OptimState8bit")``
    where torchao quantised them."""
    update = plugin.masters.updates.get(optimizer)
    step = update.generic if update is not None else None
    state = optimizer.state[weight]
    return {
        "step": type(step).__name__ if step is not None else None,
        "state": {
            key: (type(state[key]).__name__, type(local_of(state[key])).__name__) for key in ("exp_avg", "exp_avg_sq")
        },
    }


class EightBitKinds(L.Callback):
    """The Trainer's side of :func:`eightbit_kinds` (WideNet's 64x128 weight), at each step before the optimizer."""

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        module.record["8bit"] = eightbit_kinds(trainer.precision_plugin, optimizer, module.net[3].weight)


def fabric_run(
    precision: str,
    masters: Any,
    accumulate: int = 1,
    fsdp2: bool = False,
    reduce_dtype: str = "float32",
    optimizer_name: str = "sgd",
    inject: bool = False,
    stop_after_epoch: Optional[int] = None,
    resume: Optional[Path] = None,
    save_to: Optional[Path] = None,
    distributed_checkpoint: bool = True,  # Fabric's default (and the Trainer's): one file refuses 8-bit state
    monitor: Any = None,
) -> dict[str, Any]:
    net = _net(optimizer_name)
    plugin = make_plugin(precision, masters, reduce_dtype)
    # FSDP2 with fp32 masters shards in parallelize_fn; lean masters split shards, so the model is sharded before
    # fabric.setup_module (the plugin converts it there), and parallelize_fn has nothing left to do
    lean = masters == "remainder"
    if fsdp2:
        strategy: Any = FabricModelParallel(
            parallelize_fn=(lambda module, mesh: module)
            if lean
            else (lambda module, mesh: _shard(module, mesh, plugin)),
            data_parallel_size=2,
            tensor_parallel_size=1,
            save_distributed_checkpoint=distributed_checkpoint,
        )
    else:
        strategy = "ddp"
    callbacks = [monitor] if monitor is not None else []
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin], callbacks=callbacks)
    fabric.launch()
    if fsdp2:  # FSDP2: the module first, then the optimizer on its sharded parameters
        if lean:  # as docs/fabric.md says: the plugin's one-call sharding, before setup_module
            plugin.fsdp2_shard(net, mesh=fabric.strategy.device_mesh["data_parallel"])
        model = fabric.setup_module(net)
        optimizer = fabric.setup_optimizers(_optimizer(optimizer_name, model.parameters()))
    else:  # the optimizer built before setup, on the fp32 parameters
        model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    data = loader(GLOBAL_BATCH // 2 // accumulate, fabric.global_rank, 2)
    start = 0
    if resume is not None:
        rest = fabric.load(resume, {"model": model, "optimizer": optimizer})
        start = rest["epoch"] + 1
    steps, step = [], start * (len(data) // accumulate)
    for epoch in range(start, EPOCHS):
        for i, (x, y) in enumerate(data):
            if inject and step == INJECT_AT and fabric.global_rank == 0 and i % accumulate == 0:
                x = x.clone()
                x[0, 0] = float("inf")
            fabric.call("on_train_batch_start", batch=(x, y), batch_idx=i)
            last = (i + 1) % accumulate == 0
            with fabric.no_backward_sync(model, enabled=not last):
                loss = nn.functional.mse_loss(model(x).float(), y)
                fabric.backward(loss / accumulate if accumulate > 1 else loss)
            if not last:
                continue
            fabric.clip_gradients(model, optimizer, max_norm=CLIP)
            optimizer.step()
            optimizer.zero_grad()
            steps.append((step, plugin.scaler.scale, plugin.scaler.skipped_steps))
            step += 1
        if stop_after_epoch == epoch:
            fabric.save(save_to, {"model": model, "optimizer": optimizer, "epoch": epoch})
            break
    weights = {name: _full(p).cpu() for name, p in model.named_parameters()}
    state = {k: _full(v).cpu() for k, v in model.state_dict().items()}
    record = {"weights": weights, "state": state, "scaler": plugin.scaler.state_dict(), "steps": steps}
    if optimizer_name == "adamw8bit":
        record["8bit"] = eightbit_kinds(plugin, optimizer.optimizer, net[3].weight)
    return record


def eightbit_whole_file_refused() -> str:
    """Lean masters with torchao's AdamW8bit and ``save_distributed_checkpoint=False``: the error, at
    ``fabric.setup_optimizers`` (its 8-bit state, made there, cannot go into a single file), before any step."""
    net = _net("adamw8bit")
    plugin = make_plugin("bf16-mixed", "remainder")
    strategy = FabricModelParallel(
        parallelize_fn=lambda module, mesh: module,
        data_parallel_size=2,
        tensor_parallel_size=1,
        save_distributed_checkpoint=False,
    )
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin])
    fabric.launch()
    plugin.fsdp2_shard(net, mesh=fabric.strategy.device_mesh["data_parallel"])
    model = fabric.setup_module(net)
    try:
        fabric.setup_optimizers(_optimizer("adamw8bit", model.parameters()))
    except ValueError as error:
        return str(error)
    return "no error"


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x).float(), y)


def lean_fsdp2_sharded_too_late() -> str:
    """Lean masters with the sharding left to parallelize_fn (which Fabric calls after the plugin): the error."""
    plugin = make_plugin("bf16-mixed", "remainder")
    strategy = FabricModelParallel(
        parallelize_fn=lambda module, mesh: _shard(module, mesh, plugin), data_parallel_size=2, tensor_parallel_size=1
    )
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin])
    fabric.launch()
    try:
        fabric.setup_module(nn.Sequential(nn.Linear(4, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 1)))
    except ValueError as error:
        return str(error)
    return "no error"


def trainer_run(
    precision: str, masters: Any, accumulate: int, fsdp2: bool, reduce_dtype: str, optimizer_name: str
) -> dict[str, Any]:
    if fsdp2:
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        options: dict[str, Any] = dict(inject=False, shard=shard_net, accumulate=accumulate)
        if optimizer_name == "adamw8bit":
            from tests.distributed.fsdp2_lean_checks import Wide8bit

            options.update(model_class=Wide8bit, extra_callbacks=[EightBitKinds()])
        return fit(precision, masters, strategy=strategy, **options)
    return fit(precision, masters, inject=False, accumulate=accumulate, reduce_dtype=reduce_dtype)


def main() -> None:
    out = Path(sys.argv[1])
    results: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, settings in RUNS.items():
            results[name] = {"trainer": trainer_run(*settings), "fabric": fabric_run(*settings)}
        results["inject"] = fabric_run("bf16-mixed", "remainder", inject=True)
        results["lean_fsdp2_in_parallelize_fn"] = lean_fsdp2_sharded_too_late()
        results["8bit_whole_file"] = eightbit_whole_file_refused()
        monitor = FabricPrecisionMonitor(_loss, log_dir=out / "monitor", sample_every=2)
        results["monitor"] = fabric_run("bf16-mixed", "remainder", inject=True, monitor=monitor)
        results["monitor"]["history"] = monitor.history
        for masters, key, fsdp2 in (
            (True, "masters", False),
            ("remainder", "remainder", False),
            (True, "fsdp2_masters", True),
            ("remainder", "fsdp2_remainder", True),
            (True, "fsdp2_masters_dcp", True),
            ("remainder", "fsdp2_remainder_dcp", True),
            ("remainder", "fsdp2_remainder_8bit_dcp", True),
        ):
            ckpt = out / f"{key}.ckpt"
            options: dict[str, Any] = dict(fsdp2=fsdp2, inject=True, distributed_checkpoint=key.endswith("_dcp"))
            options["optimizer_name"] = "adamw8bit" if "_8bit" in key else "sgd"
            results[f"whole_{key}"] = fabric_run("bf16-mixed", masters, **options)
            fabric_run("bf16-mixed", masters, stop_after_epoch=0, save_to=ckpt, **options)
            results[f"resumed_{key}"] = fabric_run("bf16-mixed", masters, resume=ckpt, **options)
    save(results, out, torch.distributed.get_rank())
    finish()


if __name__ == "__main__":
    main()
