"""2-rank FSDP2 checks (ModelParallelStrategy + fully_shard on a CPU mesh), run by tests/test_distributed_fsdp2.py.

    python tests/distributed/fsdp2_checks.py OUT PRECISION [--masters off,on]

For each masters setting: the uninterrupted run (inf in rank 0's shard at step INJECT_AT, norm clipping, a
distributed checkpoint after epoch 0), the run resumed from it, and gradient accumulation; then, once, a run whose
inf sits in rank 1's shard only at min_scale, to read the error each rank raises. Saved to OUT/<masters>/rank<r>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_mp import DynamicLossScaler
from tests.distributed.common import finish, fit, save, shard_net


def strategy() -> ModelParallelStrategy:
    return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)


def main() -> None:
    out, precision = Path(sys.argv[1]), sys.argv[2]
    settings = sys.argv[3].split(",") if len(sys.argv) > 3 else ["off", "on"]
    for setting in settings:
        masters = setting == "on"
        ckpt = out / f"ckpt-{setting}"
        run = dict(strategy=strategy(), shard=shard_net)
        results = {"full": fit(precision, masters, checkpoint_dir=ckpt, **run)}
        run["strategy"] = strategy()
        results["resumed"] = fit(precision, masters, resume_from=ckpt / "epoch=0.ckpt", **run)
        run["strategy"] = strategy()
        results["accumulated"] = fit(precision, masters, accumulate=2, **run)
        if setting == settings[-1]:
            # every step non-finite in rank 1's shard only, at the minimum scale: both ranks raise, naming it
            at_min = DynamicLossScaler(init_scale=1.0, min_scale=1.0) if precision == "16-mixed" else (
                DynamicLossScaler.check_only(max_consecutive_skips=1))
            try:
                fit(precision, masters, scaler=at_min, inject_rank=1, inject_every=True, strategy=strategy(),
                    shard=shard_net)
                results["min_scale_error"] = None
            except FloatingPointError as error:
                results["min_scale_error"] = str(error)
        save(results, out / setting, results["full"]["rank"])
    finish()


if __name__ == "__main__":
    main()
