"""2-rank checks of writes into a set-up model (run by tests/test_model_writes_distributed.py).

    python tests/distributed/write_checks.py OUT

DDP with ``master_weights=True`` and ``"remainder"``: every write kind of tests/model_writes.py (but those that put
new parameter objects into the modules, which DDP itself refuses) into the root and a
child module, in ``on_train_start``, a callback and between steps (the same values on both ranks), steps at lr 0;
FSDP2 (ModelParallelStrategy) with both modes: loads of DTensor values into a child module and the root, and writes
in place into the shards (bf16 with ``"remainder"``, FSDP2's fp32 masters with ``True``), between steps. Each rank saves, per run, the fp32 values written and the fp32
values the model's state dict holds after the last step (``on_train_end``). Then buffers written during fit
(tests/training_writes.py) under DDP with both modes: what the model and each checkpoint hold.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_mp import MixedPrecisionPlugin
from tests.distributed.common import finish, save
from tests.model_writes import KINDS, MODES, WritingModule, fit_with_writes, snapshot
from tests.training_writes import buffers_of, fit_buffer_writer

#: writes DDP itself refuses, with any precision: new parameter objects in the modules, and ``p.data = t`` of another
#: dtype than the parameter's (an fp32 ``t`` into a bf16 parameter; torch then drops the parameter's gradient
#: accumulator, which holds DDP's hook): the next forward raises "parameters that were not used in producing the loss"
NEW_OBJECTS = ("replace", "load_assign", "data")
#: (moment, kind, target) sequences run under DDP with each master mode
DDP_WRITES = [
    [("on_train_start", kind, "child"), ("callback", kind, "root"), ("batch_end", kind, "child")]
    for kind in KINDS
    if kind not in NEW_OBJECTS
]
#: writes under FSDP2 lean (between steps: the shards are bf16 + remainder then)
FSDP2_WRITES = [("callback", "dtensor_load", "child"), ("batch_end", "fill", "root"), ("callback", "init", "child")]


def _full(value: Tensor) -> Tensor:
    return (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().float().clone()


class ShardedWritingModule(WritingModule):
    """:class:`WritingModule` sharded with FSDP2 in ``configure_model``; its writes go into DTensor parameters."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        plugin = self.trainer.precision_plugin
        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.net, mesh=mesh, mp_policy=plugin.fsdp2_policy())
        fully_shard(self, mesh=mesh, mp_policy=plugin.fsdp2_policy())

    def run_writes(self, moment: str) -> None:
        from torch.distributed.tensor import distribute_tensor

        for number, (when, kind, target) in enumerate(self.writes):
            if when != moment:
                continue
            owner, prefix = (self, "") if target == "root" else (self.net[2], "net.2.")
            generator = torch.Generator().manual_seed(number)
            params = dict(owner.named_parameters(recurse=target == "child"))
            with torch.no_grad():
                if kind == "dtensor_load":
                    values = {k: torch.randn(p.shape, generator=generator) * (1 + 2.0**-12) for k, p in params.items()}
                    owner.load_state_dict(
                        {k: distribute_tensor(v, p.device_mesh, p.placements) for (k, v), p in
                         zip(values.items(), params.values())},
                        strict=False,
                    )  # fmt: skip
                    self.expected.update({prefix + k: v for k, v in values.items()})
                    continue
                name = "scale" if target == "root" else "weight"
                param = params[name]
                if kind == "fill":
                    param.fill_(0.3)
                else:
                    nn.init.uniform_(param, -0.7, 0.7)
                self.expected[prefix + name] = _full(param)

    def on_train_end(self) -> None:
        self.saved = {key: _full(value) for key, value in self.state_dict().items()}


def main(out: Path) -> None:
    from lightning.pytorch.strategies import ModelParallelStrategy

    results: dict[str, Any] = {}
    rank = 0
    for mode in MODES:
        for writes in DDP_WRITES:
            module = fit_with_writes(mode, writes, out, strategy="ddp", devices=2)
            rank = module.global_rank
            results[f"ddp {mode} {writes[0][1]}"] = (module.saved, module.expected)
    for mode in MODES:  # True: FSDP2's sharded fp32 parameters are the masters, written directly
        torch.manual_seed(0)  # the same model on every rank
        sharded = ShardedWritingModule(FSDP2_WRITES, out)
        expected_before = snapshot(sharded)
        strategy = ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=False
        )
        module = fit_with_writes(mode, FSDP2_WRITES, out, module=sharded, strategy=strategy, devices=2)
        results[f"fsdp2 {mode}"] = (module.saved, {**expected_before, **module.expected})
    for mode in MODES:  # p.data = fp32 tensor into a bf16 parameter: refused under DDP, naming the parameter
        try:
            fit_with_writes(mode, [("callback", "data", "child")], out, strategy="ddp", devices=2)
            results[f"ddp dtype change {mode}"] = None
        except Exception as error:  # what was raised is the result
            results[f"ddp dtype change {mode}"] = f"{type(error).__name__}: {error}"
    for mode in (True, "remainder"):  # buffers written during fit (tests/training_writes.py) under DDP
        plugin = MixedPrecisionPlugin("bf16-mixed", master_weights=mode)
        writer = fit_buffer_writer([plugin], out, strategy="ddp", devices=2)
        results[f"ddp buffers {mode}"] = (buffers_of(writer), writer.checkpoints)
    save(results, out, rank)
    finish()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
