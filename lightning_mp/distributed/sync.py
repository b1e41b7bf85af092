"""What the plugin asks of the strategy at each step, and the one collective every distributed strategy shares.

:class:`GradientSync` is the single-process case: nothing to reduce, every decision is already agreed. Its
distributed subclasses (:mod:`~lightning_mp.distributed.ddp`, :mod:`~lightning_mp.distributed.fsdp2`) add what
their strategy needs. All of them take the skip decision the same way: the found-inf flag of the local gradients
is summed over the process group (:func:`agree_found_inf`: an all-reduce of the device tensor, never read on the
host here), as ``ShardedGradScaler``, DeepSpeed and Megatron do, and the optimizer skips on the agreed flag on the
device, or the host reads it where it must (see :mod:`lightning_mp.stepping`). So every rank skips the same steps
and holds the same scale, even when a user hook wrote an inf into one rank's already reduced gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch
from torch import Tensor
from torch.nn import Module

if TYPE_CHECKING:  # the plugin imports this package: its parts are named here only for type checking
    from lightning_mp.fp8.convert import Fp8Training
    from lightning_mp.master import PlainWeights
    from lightning_mp.stepping import OptimizerStep


class PluginDtypes(Protocol):
    """What the FSDP2 policy reads of :class:`~lightning_mp.MixedPrecisionPlugin` (which imports this package, so
    it is named by what it offers): its dtypes and which modules keep fp32 parameters."""

    dtype: torch.dtype
    reduce_dtype: torch.dtype

    @property
    def master_weights(self) -> bool: ...

    def params_stay_fp32(self, name: str, module: Module) -> bool: ...


class StrategyPlugin(PluginDtypes, Protocol):
    """What the strategies' parts (:class:`GradientSync` ``connect``, :func:`~lightning_mp.distributed.sync_for`,
    :func:`~lightning_mp.distributed.shard.fsdp2_shard`) use of :class:`~lightning_mp.MixedPrecisionPlugin`: its
    dtypes, its parts (step owner, masters, fp8) and the policy's entry points."""

    optimizer_in_backward: bool
    steps: OptimizerStep
    fp8: Optional[Fp8Training]

    @property
    def precision(self) -> str: ...

    @property
    def masters(self) -> Optional[PlainWeights]: ...  # what masters_for returns

    def keeps_fp32(self, name: str, module: Module) -> bool: ...

    def resolve_policy(self, module: Module) -> None: ...

    def fp8_convert(self, module: Module) -> Module: ...

    def fsdp2_policy(self, name: str = "", module: Optional[Module] = None) -> Any: ...


class GradientSync:
    """Single process: gradients are already complete and every decision is agreed. The base of the others.

    Attributes:
        owns_masters: ``True`` when the strategy keeps the fp32 master weights itself (FSDP2's sharded fp32
            parameters), so the plugin must not cast the model or build its own masters: :meth:`adopt` then gives
            :class:`~lightning_mp.master.plain.StrategyMasters`, whose lifecycle does nothing.
    """

    owns_masters = False

    def adopt(self, masters: Any) -> Any:
        """The master-weights store to use under this strategy, given the plugin's (FSDP2 makes lean masters
        sharded; here: the plugin's own, or the one a sharded store was made from)."""
        return getattr(masters, "single_device", masters)

    def connect(self, model: Module, plugin: StrategyPlugin) -> None:
        """Called from the plugin's ``connect`` with what the strategy hands it (a wrapper, for DDP)."""

    def before_backward(self) -> None:
        """Called before every backward, after the masters prepared the gradients of earlier micro-batches."""

    def backward_finished(self) -> None:
        """Called right after every backward, before ``on_after_backward`` hooks see the gradients."""

    def after_backward(self) -> None:
        """Called after every backward, once the half gradients are in the masters (when there are masters)."""

    def hand_over(self, in_backward: Any) -> None:
        """Drive ``in_backward`` (a :class:`~lightning_mp.master.in_backward.StepInBackward` made after
        :meth:`connect`: Fabric's optimizer set up after its module) where its hooks cannot (here: they can)."""

    def agree(self, found_inf: Tensor) -> Tensor:
        """The found-inf flag every rank agrees on (here: the local one)."""
        return found_inf

    def gather_names(self, names: list[str]) -> list[str]:
        """Names of parameters with non-finite gradients on any rank (here: this one's)."""
        return names

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ProcessGroupSync(GradientSync):
    """Agrees on the skip decision over a process group (the whole world unless told otherwise).

    Args:
        device: where the flag must live for the group's backend (the strategy's root device: NCCL needs CUDA).
        group: the process group; ``None`` for the default (world) group.
    """

    def __init__(self, device: torch.device, group: Optional[Any] = None) -> None:
        self.device = device
        self.group = group

    def __getstate__(self) -> dict[str, Any]:
        # a process group does not pickle (the scaler holds our gather_names; users pickle plugins): a copy
        # reduces over the default group
        return {**self.__dict__, "group": None}

    def agree(self, found_inf: Tensor) -> Tensor:
        return agree_found_inf(found_inf, self.device, self.group)

    def gather_names(self, names: list[str]) -> list[str]:
        return gather_names(names, self.group)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device}, world_size={world_size(self.group)})"


def world_size(group: Optional[Any] = None) -> int:
    """Ranks in ``group`` (1 when torch.distributed is not initialised)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 1
    return torch.distributed.get_world_size(group)


def agree_found_inf(found_inf: Tensor, device: torch.device, group: Optional[Any] = None) -> Tensor:
    """Sum the found-inf flag over ``group``: one all-reduce of one fp32 value, no host synchronisation.

    The result is ``> 0`` on every rank if any rank found a non-finite gradient. ``found_inf`` is moved to
    ``device`` first when it lives elsewhere (a step without gradients makes its flag on the CPU).
    """
    if world_size(group) == 1:
        return found_inf
    flag = found_inf.to(device=device, dtype=torch.float32)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.SUM, group=group)
    return flag


def gather_names(names: list[str], group: Optional[Any] = None) -> list[str]:
    """Every rank's ``names``, in rank order without repeats: called by all ranks at once (a collective)."""
    if world_size(group) == 1:
        return list(names)
    gathered: list[Any] = [None] * world_size(group)
    torch.distributed.all_gather_object(gathered, list(names), group=group)
    merged: dict[str, None] = {}
    for rank_names in gathered:
        merged.update(dict.fromkeys(rank_names or []))
    return list(merged)


_REDUCE_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "16": torch.float16,
}


def reduce_dtype_of(value: Any) -> torch.dtype:
    """``reduce_dtype`` as a ``torch.dtype``: ``torch.float32`` / ``bfloat16`` / ``float16`` or one of their names
    (``"float32"``, ``"fp32"``, ``"bf16"``, ``"float16"``, ...), so that YAML can set it.

    Raises:
        ValueError: any other value (the message lists the allowed ones).
    """
    if isinstance(value, torch.dtype) and value in _REDUCE_DTYPES.values():
        return value
    if isinstance(value, str) and value.lower().removeprefix("torch.") in _REDUCE_DTYPES:
        return _REDUCE_DTYPES[value.lower().removeprefix("torch.")]
    raise ValueError(
        f"reduce_dtype={value!r} is not supported: use torch.float32 (the default), torch.bfloat16 or torch.float16, "
        f"or one of the names {sorted(_REDUCE_DTYPES)}."
    )
