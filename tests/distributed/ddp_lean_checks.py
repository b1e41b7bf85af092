"""2-rank DDP checks of lean master weights (run by tests/test_lean_masters_distributed.py).

    python tests/distributed/ddp_lean_checks.py OUT

bf16-mixed with ``master_weights="remainder"``: the uninterrupted run (inf on rank 0 at step INJECT_AT, norm
clipping, a checkpoint after epoch 0), the run resumed from it, gradient accumulation in fp32 (the default: 2 and 3
micro-batches, automatic and manual optimization, fp32 and bf16 reduction, a parameter DDP ignores) and in bf16, and
a run with bf16 gradient reduction, and one with torchao's ``AdamW8bit`` (``adam8bit``). Each rank saves what it saw to OUT/rank<r>.pt; runs with accumulation also keep every micro-batch's
local bf16 gradient of the first layer's weight at step 0 (``micro_grads``) next to the gradient the step used
(``grads``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from tests.distributed.common import Adam8bitNet, ManualNet, Net, finish, fit, save


class HookProbe(L.Callback):
    """Which communication hooks DDP holds, once training started (the plugin's own in reduce_dtype)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        hooks = getattr(trainer.strategy.model, "_comm_hooks", [])
        pl_module.record["comm_hooks"] = [getattr(hook, "__name__", repr(hook)) for hook, _ in hooks]


class MicroGradProbe(L.Callback):
    """Every backward's own bf16 gradient of the first layer's weight and bias during step 0, before anything adds
    them up; the bias gradient the step sees."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.handles = []
        for param, key in ((pl_module.net[0].weight, "micro_grads"), (pl_module.net[0].bias, "micro_bias_grads")):
            grads = pl_module.record.setdefault(key, [])

            def keep(grad: torch.Tensor, grads: list = grads) -> None:
                if trainer.global_step == 0:
                    grads.append(grad.detach().float().clone())

            self.handles.append(param.register_hook(keep))

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if trainer.global_step == 0:
            grad = pl_module.net[0].bias.grad
            pl_module.record["bias_grad"], pl_module.record["bias_grad_dtype"] = grad.float().clone(), grad.dtype

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for handle in self.handles:
            handle.remove()
        logging_data = trainer.strategy.model._get_ddp_logging_data()  # DDP's own record of its buckets
        pl_module.record["bucket_sizes"] = [int(size) for size in logging_data["bucket_sizes"].split(",")]


#: runs with fp32 accumulation (the default): name -> (accumulate, manual optimization, reduce_dtype)
FP32_SUMS = {
    "acc2": (2, False, "float32"),
    "acc3": (3, False, "float32"),
    "acc2_bf16_reduce": (2, False, "bf16"),
    "manual_acc2": (2, True, "float32"),
    "manual_acc3_bf16_reduce": (3, True, "bf16"),
    # DDPStrategy(bucket_cap_mb_list=[SMALL_BUCKETS_MB] * 8): the bf16 gradients in two buckets at step 0 (DDP
    # rebuilds its buckets after the first step, ignoring the list: one bucket per dtype then)
    "acc3_small_buckets": (3, False, "float32"),
}
SMALL_BUCKETS_MB = 1e-4  # 100 bytes


class IgnoredBiasNet(Net):
    """``Net`` whose first bias DDP is told to ignore: not in any bucket, so never reduced (each rank keeps its own)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(self, ["net.0.bias"])


def main() -> None:
    out = Path(sys.argv[1])
    ckpt = out / "ckpt"
    results = {"full": fit("bf16-mixed", "remainder", checkpoint_dir=ckpt, extra_callbacks=[HookProbe()])}
    results["resumed"] = fit("bf16-mixed", "remainder", resume_from=ckpt / "epoch=0.ckpt")
    bf16_sums = {"kind": "remainder", "accumulate_grads_in": "bf16"}
    results["accumulated"] = fit("bf16-mixed", bf16_sums, accumulate=2, extra_callbacks=[MicroGradProbe()])
    for name, (accumulate, manual, reduce_dtype) in FP32_SUMS.items():
        results[name] = fit(
            "bf16-mixed",
            "remainder",
            accumulate=accumulate,
            reduce_dtype=reduce_dtype,
            extra_callbacks=[MicroGradProbe()],
            model_class=ManualNet if manual else Net,
            strategy=DDPStrategy(bucket_cap_mb_list=[SMALL_BUCKETS_MB] * 8)
            if name.endswith("small_buckets")
            else "ddp",
        )
    results["ignored_bias"] = fit(
        "bf16-mixed", "remainder", accumulate=2, extra_callbacks=[MicroGradProbe()], model_class=IgnoredBiasNet
    )
    results["bf16_reduce"] = fit("bf16-mixed", "remainder", reduce_dtype="bf16")
    if importlib.util.find_spec("torchao") is not None:  # torchao's AdamW8bit in one pass (master/lean/eightbit.py)
        results["adam8bit"] = fit("bf16-mixed", "remainder", model_class=Adam8bitNet)
    save(results, out, results["full"]["rank"])
    finish()


if __name__ == "__main__":
    main()
