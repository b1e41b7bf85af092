"""Lean master weights (``master_weights="remainder"``): a bf16 model plus a 16-bit remainder per element, together
the fp32 masters bit for bit, without an fp32 copy of the model.

- :mod:`~lightning_mp.master.lean.store`: :class:`RemainderMasters`, the store (storage only: the weights interface
  of :mod:`lightning_mp.master.plain` over the blocks), beside :class:`~lightning_mp.master.MasterWeights`;
- :mod:`~lightning_mp.master.lean.blocks`: where the bf16 halves and remainders live (blocks built at convert and
  given back as fp32 at restore, one at a time), and the exact join and split by chunks;
- :mod:`~lightning_mp.master.lean.clipping`: the fp32 gradient norms of clipping by norm;
- :mod:`~lightning_mp.master.lean.optimizer_state`: the optimizer's side (its parameters belong to the model, its fp32
  state kept across ``load_state_dict``).
"""

from lightning_mp.master.lean.store import RemainderMasters

__all__ = ["RemainderMasters"]
