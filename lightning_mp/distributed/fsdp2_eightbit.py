"""torchao's ``AdamW8bit`` / ``Adam8bit`` in one pass on FSDP2's local shards.

:class:`~lightning_mp.master.lean.eightbit.Adam8bitStep` (the one-pass kernel: join, dequantize, update, split,
requantize) on each rank's local shards, as the store of
:class:`~lightning_mp.distributed.fsdp2_lean.ShardedRemainderMasters` lays them out: the bf16 shard (FSDP2's own
storage) and its int16 remainder, this rank's gradient shard, and the local ``OptimState8bit`` (codes, scales, map)
inside each state ``DTensor``. torchao's step on FSDP2's fp32 parameters works shard by shard too: its state is made
by ``_new_buffer`` on the local shard (quantised where the shard has at least 4096 values and whole blocks, from the
shard's start) and wrapped in a ``DTensor`` sharded like the parameter, and its update of an element reads that
element, its gradient and its block's scale only. So each rank's step is torchao's on its exact fp32 shard, bitwise
(``tests/test_lean_masters_fsdp2.py``), with no collective: a skip is the agreed flag, a clip the factor of the norm
over every rank (:meth:`~lightning_mp.distributed.fsdp2_lean.ShardedRemainderMasters._total_norm`).

The state is keyed by the model's sharded parameters, as torchao keys it on FSDP2's fp32 parameters, so torch's
distributed checkpoint saves each rank's shard of it under the parameter's name. What that needs, here:

- the state is made at setup (:meth:`~Adam8bitStep.initial_state`), as the table's optimizers' is: a distributed
  checkpoint load runs a step of an optimizer without state first (torch's ``_init_optim_state``), which would make
  it through torchao's own step;
- a quantised state cannot go into a whole-file checkpoint (``save_distributed_checkpoint=False``): refused at setup,
  before the first step, and again at a save (the state made again later, after a clear);
- the fp32 state survives ``load_state_dict`` (torch would cast it to the bf16 parameters' dtype): the store's
  ``keep_fp32_state`` hooks, as on one device.
"""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer

from lightning_mp.distributed.fsdp2_generic import check_sharded_params, check_sharded_state
from lightning_mp.master.lean.eightbit import Adam8bitStep
from lightning_mp.master.lean.interface import LeanStore


class ShardedAdam8bitStep(Adam8bitStep):
    """:class:`~lightning_mp.master.lean.eightbit.Adam8bitStep` on FSDP2's local shards (module doc).

    Raises:
        ValueError: a parameter of ``optimizer`` is not sharded by ``fully_shard``.
    """

    sharded = True

    def __init__(self, optimizer: Optimizer, store: LeanStore, chunk_size: int = 0) -> None:
        check_sharded_params(optimizer)
        super().__init__(optimizer, store, chunk_size)
        self._hooks: list[Any] = [
            optimizer.register_state_dict_pre_hook(lambda opt: check_sharded_state(opt, store), prepend=True)
        ]

    def initial_state(self) -> None:
        """The state of every trainable parameter made now (the base's), then checked: a quantised state with
        whole-file checkpoints is refused here, at setup, before any step.

        Raises:
            ValueError: a state a checkpoint would save wrongly (see
                :func:`~lightning_mp.distributed.fsdp2_generic.check_sharded_state`)."""
        super().initial_state()
        check_sharded_state(self.optimizer, self.store)

    def restore(self) -> None:
        """At teardown: the state stays keyed by the parameters; the save check is removed."""
        super().restore()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
