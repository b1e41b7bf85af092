"""2-rank DDP checks of lean master weights (run by tests/test_lean_masters_distributed.py).

    python tests/distributed/ddp_lean_checks.py OUT

bf16-mixed with ``master_weights="remainder"``: the uninterrupted run (inf on rank 0 at step INJECT_AT, norm
clipping, a checkpoint after epoch 0), the run resumed from it, gradient accumulation (2 micro-batches, bf16 sums; fp32 sums are refused) and a run
with bf16 gradient reduction. Each rank saves what it saw to OUT/rank<r>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L

from tests.distributed.common import finish, fit, save


class HookProbe(L.Callback):
    """Which communication hooks DDP holds, once training started (the plugin's own in reduce_dtype)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        hooks = getattr(trainer.strategy.model, "_comm_hooks", [])
        pl_module.record["comm_hooks"] = [getattr(hook, "__name__", repr(hook)) for hook, _ in hooks]


def main() -> None:
    out = Path(sys.argv[1])
    ckpt = out / "ckpt"
    results = {"full": fit("bf16-mixed", "remainder", checkpoint_dir=ckpt, extra_callbacks=[HookProbe()])}
    results["resumed"] = fit("bf16-mixed", "remainder", resume_from=ckpt / "epoch=0.ckpt")
    bf16_sums = {"kind": "remainder", "accumulate_grads_in": "bf16"}
    results["accumulated"] = fit("bf16-mixed", bf16_sums, accumulate=2)
    try:  # fp32 accumulation cannot pass through DDP's bf16 buckets: refused at setup, saying what to use
        fit("bf16-mixed", "remainder", accumulate=2)
        results["fp32_accumulation_error"] = None
    except ValueError as error:
        results["fp32_accumulation_error"] = str(error)
    results["bf16_reduce"] = fit("bf16-mixed", "remainder", reduce_dtype="bf16")
    save(results, out, results["full"]["rank"])
    finish()


if __name__ == "__main__":
    main()
