"""2-rank FSDP2 runs whose checkpoints tests/test_consolidate.py turns into one fp32 file, in a single process.

    python tests/distributed/consolidate_checks.py OUT PRECISION

For masters off and on: a run that writes a distributed checkpoint after each epoch (OUT/ckpt-<masters>/, the
ModelParallelStrategy default); with masters also a run that writes single files (OUT/ckpt-file/). The weights each
run ended with (whole, gathered from the shards) are saved to OUT/<masters>/rank<r>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch.strategies import ModelParallelStrategy

from tests.distributed.common import finish, fit, save, shard_net


def main() -> None:
    out, precision = Path(sys.argv[1]), sys.argv[2]
    for masters in (False, True):
        setting = "on" if masters else "off"
        results = {
            "sharded": fit(
                precision,
                masters,
                checkpoint_dir=out / f"ckpt-{setting}",
                shard=shard_net,
                strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
            )
        }
        if masters:
            strategy = ModelParallelStrategy(
                data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=False
            )
            results["file"] = fit(
                precision, masters, checkpoint_dir=out / "ckpt-file", shard=shard_net, strategy=strategy
            )
        save(
            {name: {"weights": run["weights"], "param_dtype": run["param_dtype"]} for name, run in results.items()},
            out / setting,
            results["sharded"]["rank"],
        )
    finish()


if __name__ == "__main__":
    main()
