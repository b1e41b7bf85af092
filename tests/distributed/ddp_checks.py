"""2-rank DDP checks (run by tests/test_distributed_ddp.py through tests/distributed/launch.py).

    python tests/distributed/ddp_checks.py OUT PRECISION [--masters off,on]

For each masters setting: the uninterrupted run (inf on rank 0 at step INJECT_AT, norm clipping, a checkpoint after
epoch 0), the run resumed from that checkpoint, gradient accumulation (2 micro-batches of half the size), and a
run with bf16 gradient reduction. Each rank saves what it saw to OUT/<masters>/rank<r>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from tests.distributed.common import finish, fit, save


def fused_run(precision: str, masters: bool) -> tuple[dict, list[int]]:
    """The uninterrupted run with SGD(fused=True), which skips on the device; the host syncs of each step's
    decision, optimizer step and scaler update (OptimizerStep._step_or_skip) counted on this rank."""
    from lightning_mp import stepping
    from tests.helpers import HostSyncCounter

    counts: list[int] = []
    original = stepping.OptimizerStep._step_or_skip

    def counted(*args, **kwargs):
        with HostSyncCounter() as counter:
            result = original(*args, **kwargs)
        counts.append(len(counter.calls))
        return result

    stepping.OptimizerStep._step_or_skip = counted
    stepping.DECIDE_CPU_FLAGS_ON_HOST = False  # the accelerators' path, on these CPU ranks
    try:
        return fit(precision, masters, fused=True), counts
    finally:
        stepping.OptimizerStep._step_or_skip = original
        stepping.DECIDE_CPU_FLAGS_ON_HOST = True


def main() -> None:
    out, precision = Path(sys.argv[1]), sys.argv[2]
    settings = sys.argv[3].split(",") if len(sys.argv) > 3 else ["off", "on"]
    for setting in settings:
        masters = setting == "on"
        ckpt = out / f"ckpt-{setting}"
        results = {"full": fit(precision, masters, checkpoint_dir=ckpt)}
        results["resumed"] = fit(precision, masters, resume_from=ckpt / "epoch=0.ckpt")
        results["accumulated"] = fit(precision, masters, accumulate=2)
        results["bf16_reduce"] = fit(precision, masters, reduce_dtype="bf16")
        results["fused"], results["fused_step_syncs"] = fused_run(precision, masters)
        if masters:  # a communication hook of the user's own: refused at setup (DDP takes one, ours is needed)
            try:
                fit(precision, masters, strategy=DDPStrategy(ddp_comm_hook=default_hooks.allreduce_hook))
                results["user_hook_error"] = None
            except ValueError as error:
                results["user_hook_error"] = str(error)
        save(results, out / setting, results["full"]["rank"])
    finish()


if __name__ == "__main__":
    main()
