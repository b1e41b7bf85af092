"""2-rank FSDP2 + fp8 checks (emulated on CPU, gloo), run by tests/test_fp8_fsdp2.py.

    python tests/distributed/fp8_fsdp2_checks.py OUT

- ``refused``, ``refused_root``: configure_model shards without converting first (each Linear on its own, or only
  the root); the plugin's setup must refuse before any step.
- ``manual``: ``plugin.fp8_convert(self)`` then ``fully_shard`` by hand (the norm alone, two blocks, the net).
- ``helper``: ``plugin.fsdp2_shard(self, blocks=..., root=self.net)``, the same grouping in one call; writes a
  distributed checkpoint after each epoch (OUT/ckpt-<masters>/), and ``resumed`` continues from the first one.
- ``plain``, ``helper_plain``: the same two ways with ``fp8=None`` (and ``*_remainder``: with lean masters).
- ``file``: as ``helper`` with single-file checkpoints (OUT/ckpt-file/), and ``file_resumed``.
Saved to OUT/rank<r>.pt: losses, the whole final weights, layer types, what each fp8 layer's weight is.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_mp import MixedPrecisionPlugin
from tests.distributed.common import finish, save
from tests.distributed.fp8_checks import TrainsOnShards, _full

# 64 samples, 2 ranks, batch 8: 4 steps per epoch. max_epochs, not max_steps: Lightning 2.6.6 itself (one device, no
# plugin) resumed with max_steps from a checkpoint saved at a training epoch's end runs batch 0 again as batch 4
EPOCHS = 2


class Net(TrainsOnShards, L.LightningModule):
    """Linear -> GELU -> LayerNorm -> Linear -> GELU -> Linear; ``how`` the user's configure_model shards it."""

    def __init__(self, how: str = "none") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 16)
        )
        self.how = how
        self.losses: list[float] = []
        self.norm_dtypes: set[str] = set()
        self.net[2].register_forward_pre_hook(lambda module, args: self.norm_dtypes.add(str(module.weight.dtype)))

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        plugin = self.trainer.precision_plugin
        if self.how == "helper":
            plugin.fsdp2_shard(self, blocks=[self.net[0], self.net[3]], root=self.net)
            return
        if self.how == "manual":
            plugin.fp8_convert(self)  # before fully_shard: FSDP2 keeps the modules it shards
        mesh = self.device_mesh["data_parallel"]
        if self.how == "unconverted_root":  # the Linear layers stay nn.Linear, inside the sharded root
            fully_shard(self.net, mesh=mesh, mp_policy=plugin.fsdp2_policy())
            return
        fully_shard(self.net[2], mesh=mesh, mp_policy=plugin.fsdp2_policy("net.2", self.net[2]))
        for index in (0, 3):
            fully_shard(self.net[index], mesh=mesh, mp_policy=plugin.fsdp2_policy())
        fully_shard(self.net, mesh=mesh, mp_policy=plugin.fsdp2_policy())


def run(
    how: str,
    masters: Any,
    checkpoints: Optional[Path] = None,
    resume: Optional[Path] = None,
    files: bool = False,
    fp8: Any = "tensorwise",
) -> dict[str, Any]:
    from lightning.pytorch.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(
        data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=not files
    )
    plugin = MixedPrecisionPlugin("bf16-mixed", fp8=fp8, master_weights=masters)
    model = Net(how)
    callbacks = []
    if checkpoints is not None:
        callbacks.append(
            ModelCheckpoint(dirpath=checkpoints, filename="{epoch}", save_top_k=-1, save_on_train_epoch_end=True)
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        plugins=[plugin],
        max_epochs=EPOCHS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        enable_checkpointing=checkpoints is not None,
        use_distributed_sampler=False,
        deterministic=True,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model, ckpt_path=resume)
        except ValueError as error:
            return {"error": str(error), "losses": model.losses}
    weights = {name: _full(param) for name, param in model.named_parameters()}
    return {
        "losses": model.losses,
        "weights": weights,
        "norm_dtypes": sorted(model.norm_dtypes),
        "layers": {name: type(module).__name__ for name, module in model.net.named_children()},
        "weight_kinds": {
            name: type(getattr(param, "_local_tensor", param)).__name__ for name, param in model.named_parameters()
        },
        "state_dict_kinds": sorted(
            {type(getattr(v, "_local_tensor", v)).__name__ for v in model.state_dict().values()}
        ),
        "warnings": sorted({str(w.message) for w in caught if "fp8" in str(w.message) or "norm" in str(w.message)}),
        "rank": trainer.global_rank,
    }


def main() -> None:
    out = Path(sys.argv[1])
    results: dict[str, Any] = {
        "refused": run("unconverted", True),
        "refused_root": run("unconverted_root", False),
        "manual": run("manual", True),
    }
    for masters in (True, False):
        folder = out / f"ckpt-{'on' if masters else 'off'}"
        results[f"helper-{masters}"] = run("helper", masters, checkpoints=folder)
        results[f"resumed-{masters}"] = run("helper", masters, resume=folder / "epoch=0.ckpt")
    results["plain"] = run("plain", True, fp8=None)  # without fp8: the same order by hand and with fsdp2_shard
    results["helper_plain"] = run("helper", True, fp8=None)
    # lean masters (bf16 shards + int16 remainders): fsdp2_shard gives the same groups and policies as by hand
    results["plain_remainder"] = run("plain", "remainder", fp8=None)
    results["helper_plain_remainder"] = run("helper", "remainder", fp8=None)
    results["file"] = run("helper", True, checkpoints=out / "ckpt-file", files=True)
    results["file_resumed"] = run("helper", True, resume=out / "ckpt-file" / "epoch=0.ckpt", files=True)
    save(results, out, torch.distributed.get_rank())
    finish()


if __name__ == "__main__":
    main()
