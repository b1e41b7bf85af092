"""Lean master weights (``master_weights="remainder"``): a bf16 model plus a 16-bit remainder per element, together
the fp32 masters bit for bit, without an fp32 copy of the model; and their update.

The store:

- :mod:`~lightning_mp.master.lean.store`: :class:`RemainderMasters`, the store (storage only: the weights interface
  of :mod:`lightning_mp.master.plain` over the blocks), beside :class:`~lightning_mp.master.MasterWeights`;
- :mod:`~lightning_mp.master.lean.blocks`: where the bf16 halves and remainders live (blocks built at convert and
  given back as fp32 at restore, one at a time), and the exact join and split by chunks;
- :mod:`~lightning_mp.master.lean.clipping`: the fp32 gradient norms of clipping by norm;
- :mod:`~lightning_mp.master.lean.optimizer_state`: the optimizer's side (its parameters belong to the model, its fp32
  state kept across ``load_state_dict``).

The update:

- :mod:`~lightning_mp.master.lean.optimizers`: THE table of the optimizers the fast paths know;
- :mod:`~lightning_mp.master.lean.update`: THE dispatch, chosen once per optimizer, called by the normal step and by
  the step inside backward;
- the paths it chooses among: the one-pass update by its step plan (:mod:`~lightning_mp.master.lean.plan`), the
  chunked update with torch's own fused or foreach function (:mod:`~lightning_mp.master.lean.chunked`), and any other
  optimizer on fp32 slices (:mod:`~lightning_mp.master.lean.generic`).
"""

from lightning_mp.master.lean.store import RemainderMasters

__all__ = ["RemainderMasters"]
