"""2-rank FSDP2 checks (ModelParallelStrategy + fully_shard on a CPU mesh), run by tests/test_distributed_fsdp2.py.

    python tests/distributed/fsdp2_checks.py OUT PRECISION [--masters off,on]

For each masters setting: the uninterrupted run (inf in rank 0's shard at step INJECT_AT, norm clipping, a
distributed checkpoint after epoch 0), the run resumed from it, and gradient accumulation; then, once, a run whose
inf sits in rank 1's shard only at min_scale, to read the error each rank raises. With masters also: a full
(single-file) checkpoint resumed, and a casting policy with an fp32 module (sharded with its policy, and not: the
error). Saved to OUT/<masters>/rank<r>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_mp import DynamicLossScaler, MixedPrecisionPlugin
from tests.distributed.common import Net, finish, fit, save, shard_net


def strategy(**kwargs: object) -> ModelParallelStrategy:
    return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, **kwargs)


POLICY = {"fp32_modules": ["net.3"]}  # the head in fp32: a module rule of the casting policy


def shard_net_whole(module: Net, plugin: MixedPrecisionPlugin) -> None:
    """One group for the whole net, norm included."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(module.net, mesh=module.device_mesh["data_parallel"], mp_policy=plugin.fsdp2_policy())


def shard_with_fp32_head(module: Net, plugin: MixedPrecisionPlugin) -> None:
    """The user shards what the plugin keeps in fp32 on its own (norm, head), each with its policy, then the net."""
    from torch.distributed.fsdp import fully_shard

    mesh = module.device_mesh["data_parallel"]
    for name in ("1", "3"):
        child = module.net.get_submodule(name)
        fully_shard(child, mesh=mesh, mp_policy=plugin.fsdp2_policy(f"net.{name}", child))
    fully_shard(module.net, mesh=mesh, mp_policy=plugin.fsdp2_policy())


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
        if masters:
            full_ckpt = out / "ckpt-full-file"
            fit(
                precision,
                masters,
                checkpoint_dir=full_ckpt,
                strategy=strategy(save_distributed_checkpoint=False),
                shard=shard_net,
            )
            results["resumed_from_file"] = fit(
                precision, masters, resume_from=full_ckpt / "epoch=0.ckpt", strategy=strategy(), shard=shard_net
            )
            results["policy"] = fit(precision, masters, policy=POLICY, strategy=strategy(), shard=shard_with_fp32_head)
            try:  # the head left inside the half-precision group: refused at setup, naming it
                fit(precision, masters, policy=POLICY, strategy=strategy(), shard=shard_net)
                results["policy_error"] = None
            except ValueError as error:
                results["policy_error"] = str(error)
            # the norm left in the half-precision group: a warning at setup, and training goes on
            results["norm_in_half"] = fit(precision, masters, strategy=strategy(), shard=shard_net_whole)
        if setting == settings[-1]:
            # every step non-finite in rank 1's shard only, at the minimum scale: both ranks raise, naming it
            at_min = (
                DynamicLossScaler(init_scale=1.0, min_scale=1.0)
                if precision == "16-mixed"
                else (DynamicLossScaler.check_only(max_consecutive_skips=1))
            )
            try:
                fit(
                    precision,
                    masters,
                    scaler=at_min,
                    inject_rank=1,
                    inject_every=True,
                    strategy=strategy(),
                    shard=shard_net,
                )
                results["min_scale_error"] = None
            except FloatingPointError as error:
                results["min_scale_error"] = str(error)
        save(results, out / setting, results["full"]["rank"])
    finish()


if __name__ == "__main__":
    main()
