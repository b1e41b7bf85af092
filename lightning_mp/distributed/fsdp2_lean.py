"""Lean master weights under FSDP2: sharded bf16 parameters plus sharded 16-bit remainders, no fp32 shard at rest.

``master_weights="remainder"`` with ``ModelParallelStrategy``. The user shards the model in ``configure_model`` with
``plugin.fsdp2_policy(...)`` (``param_dtype`` bf16, fp32 for the modules the plugin keeps in fp32, ``reduce_dtype``
the plugin's). Then, just before the first forward (:meth:`ShardedRemainderMasters.convert` prepares it; Lightning
has restored any checkpoint into the fp32 shards by then, exactly), each rank splits the exact fp32 values of its
local shards of every parameter that FSDP2 computes in bf16 into

- a bf16 local shard, written into a new (padded) storage that FSDP2 takes as its own (``_sharded_param_data``):
  the sharded parameter becomes a bf16 ``DTensor``, so FSDP2 all-gathers it as it is (no cast) and reduce-scatters
  the bf16 gradients in ``reduce_dtype`` (fp32 by default) into bf16 sharded gradients;
- an int16 remainder of the same local shape (:mod:`lightning_mp.kernels.bits`).

Parameters of modules sharded with ``param_dtype=torch.float32`` (normalisation layers, the policy's
``fp32_modules``) stay fp32 shards without remainder, updated in place. The step
(:meth:`~lightning_mp.master.RemainderMasters.fused_step`) walks each local shard in chunks, joins bf16 + remainder
into fp32, runs the optimizer's entry of :mod:`lightning_mp.master.lean.optimizers` on it (torch's fused kernel, or its
foreach function) and this rank's gradient shard, and splits back: what torch's optimizer computes on fp32 shards
holding the exact values, bitwise. A chunk never spans two shards (their bf16 halves are separate FSDP2 storages).
torchao's ``AdamW8bit`` / ``Adam8bit`` run in one pass on the local shards, as on one device
(:mod:`lightning_mp.distributed.fsdp2_eightbit`). Other optimizers run their own step on ``DTensor`` proxies of the
whole local shards (:mod:`lightning_mp.distributed.fsdp2_generic`).

Memory at rest per rank and local element with AdamW: 2 (bf16 shard) + 2 (remainder) + 2 (bf16 gradient shard) + 8
(fp32 moments, sharded like the parameter) = 14 bytes. With fp32 accumulation (the default) the gradient shards
become fp32 before each further backward and FSDP2 adds each micro-batch's reduced (bf16) gradient into them.

Checkpoints: the model's ``state_dict`` holds fp32 ``DTensor`` s (bf16 shard joined with its remainder): distributed
checkpoints store exact fp32 shards, full ones exact fp32 tensors. Loading before the first forward (Lightning's
resume) goes into the fp32 shards; later, ``load_state_dict`` into any module with fp32 values is split back exactly
(:mod:`lightning_mp.master.model_sync` owns those hooks), and a write in place into a bf16 shard zeroes its
remainder; torch's ``set_model_state_dict`` with a *full* state dict copies each slice into the bf16 shard in place
(rounding it) before any hook sees it: followed as such a write (the rounded bf16 value). Optimizer states are fp32 ``DTensor`` s made at setup (torch's distributed checkpoint would
otherwise make them with a step on the bf16 parameters, in bf16). FSDP2's internals used here
(``_sharded_param_data``, ``reset_sharded_param``, ``_init_mp_dtypes``) are those of torch 2.13, tested on CPU/gloo.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from functools import partial
from typing import TYPE_CHECKING, Any, Optional, cast

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mp.distributed.fsdp2_eightbit import ShardedAdam8bitStep
from lightning_mp.distributed.fsdp2_generic import ShardedGenericStep
from lightning_mp.distributed.shard import fsdp_param_groups
from lightning_mp.kernels.bits import join_fp32, split_fp32_into
from lightning_mp.master.lean.optimizer_state import check_params_belong, keep_fp32_state
from lightning_mp.master.lean.optimizers import entry_for, initial_state, local_of
from lightning_mp.master.lean.store import RemainderMasters
from lightning_mp.master.model_sync import ModelSync, materialise

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def fsdp_params(module: nn.Module) -> list[Any]:
    """Every ``FSDPParam`` of the ``fully_shard`` groups inside ``module``, with the group's ``mp_policy``."""
    from torch.distributed.fsdp import FSDPModule

    found: dict[int, Any] = {}
    for owner in module.modules():
        if isinstance(owner, FSDPModule):
            for group in fsdp_param_groups(owner):
                for fsdp_param in group.fsdp_params:
                    found.setdefault(id(fsdp_param), (fsdp_param, group))
    return list(found.values())


class ShardedRemainderMasters(RemainderMasters):
    """:class:`~lightning_mp.master.RemainderMasters` on FSDP2's local shards (see module doc). Made by the FSDP2
    strategy's side of the plugin from the plugin's own store (:meth:`like`); same options."""

    #: the plugin's own store this one was made from (:meth:`like`); what the plugin keeps outside FSDP2
    single_device: RemainderMasters
    #: whether checkpoints are whole, not distributed (the strategy's setting; read by the generic path)
    whole_checkpoints = False

    @classmethod
    def like(cls, masters: RemainderMasters) -> ShardedRemainderMasters:
        sharded = cls(
            masters.dtype, masters.keep_fp32, masters.chunk_size, masters.accumulate_grads_in, masters.compile
        )
        sharded.single_device = masters
        return sharded

    def _reset(self) -> None:
        super()._reset()
        self._shards: dict[int, tuple[Any, Any, Tensor]] = {}  # id(param) -> (FSDPParam, its group, int16 remainder)
        self._starts: list[int] = []  # where each shard starts in the (virtual) flat layout, ascending
        self._at: list[nn.Parameter] = []  # the parameter starting there
        self._unsplit: list[tuple[Any, Any]] = []  # (FSDPParam, group) to split before the first forward
        self._forward_hooks: list[Any] = []

    # ------------------------------------------------------------------ setup
    def convert(self, module: nn.Module) -> nn.Module:
        """Prepare the split of every floating parameter that FSDP2 computes in bf16 into a bf16 sharded parameter
        plus a remainder, made from its exact fp32 shard just before the first forward (of training, or of the
        sanity check), after Lightning restored any checkpoint into the fp32 shards. Runs after ``fully_shard``.

        Raises:
            ValueError: no module is sharded with ``fully_shard``, or a shard is a tensor subclass (fp8 all-gather).
        """
        from torch.distributed.fsdp import FSDPModule

        if self._module is not None:
            self.restore()
        found = fsdp_params(module)
        if not found:
            raise ValueError(
                "MixedPrecisionPlugin(master_weights='remainder') under ModelParallelStrategy keeps FSDP2's sharded "
                "parameters in bf16 with 16-bit remainders, but no module of the model was sharded with fully_shard. "
                "In configure_model call fully_shard(module, mesh=self.device_mesh['data_parallel'], "
                "mp_policy=self.trainer.precision_plugin.fsdp2_policy()) (and on the root)."
            )
        self._module = module
        self._unsplit = []
        names = {id(param): name for name, param in module.named_parameters()}
        for fsdp_param, group in found:
            param = fsdp_param.sharded_param
            if group.mp_policy.param_dtype != torch.bfloat16 or not param.is_floating_point():
                continue  # an fp32 group (norms, fp32_modules): trained in fp32, no remainder
            if type(local_of(param)) is not torch.Tensor:
                raise ValueError(
                    f"master_weights='remainder' under FSDP2 cannot split the shard of {names.get(id(param))} "
                    f"({type(local_of(param)).__name__}, a tensor subclass such as torchao's fp8 all-gather weights): "
                    "with fp8 use a rowwise recipe (fp8='rowwise': all-gathered in bf16, works with 'remainder'), or "
                    "master_weights=True under FSDP2."
                )
            self._unsplit.append((fsdp_param, group))
        # FSDP2 registers its own pre-forward hooks first (prepend): these run before them, on whichever sharded
        # module runs first, so the shards are bf16 before FSDP2 fixes its dtypes at its lazy initialisation
        self._forward_hooks = [
            owner.register_forward_pre_hook(self._split_before_forward, prepend=True)
            for owner in module.modules()
            if isinstance(owner, FSDPModule)
        ]
        return module

    def _split_before_forward(self, module: nn.Module, args: Any) -> None:
        if self._unsplit:
            self.split_shards()

    def split_shards(self) -> None:
        """Split the fp32 shards now (done before the first forward; a no-op once done)."""
        assert self._module is not None
        offset = 0
        with torch.no_grad():
            for fsdp_param, group in self._unsplit:
                param = fsdp_param.sharded_param
                local = local_of(param)
                low = torch.empty(local.shape, dtype=torch.int16, device=local.device)
                high = _swap_shard(fsdp_param, group, local, torch.bfloat16, partial(self._split, low=low))
                self._params[id(param)] = param
                self._shards[id(param)] = (fsdp_param, group, low)
                self._layout[id(param)] = (high.device, offset)
                self._starts.append(offset)
                self._at.append(param)
                offset += high.numel() + 1  # a gap: plan_chunks never joins two shards into one chunk
        _retype_groups([group for _, group in self._unsplit])
        self._unsplit = []
        for hook in self._forward_hooks:
            hook.remove()
        # loads into any module, saves, and writes in place reach the remainders from now on (FSDP2 swaps sharded and
        # unsharded parameters in the modules itself: only version counters are compared, not objects or storage)
        self.model_sync = ModelSync(self, self._module, self._params, watch_objects=False)
        self.model_sync.start()

    def _split(self, value: Tensor, high: Tensor, low: Tensor) -> None:
        flat, high, low = value.reshape(-1), high.view(-1), low.view(-1)
        step = self.chunk_size_for(flat.device)
        for start in range(0, flat.numel(), step):  # the split's temporaries: one chunk's worth
            stop = min(start + step, flat.numel())
            split_fp32_into(flat[start:stop].float(), high[start:stop], low[start:stop])

    def attach(self, optimizers: Iterable[Optimizer]) -> None:
        """Give the optimizers of the table (:mod:`lightning_mp.master.lean.optimizers`) fp32 sharded state now, and
        torchao's 8-bit Adam its own (:mod:`~lightning_mp.distributed.fsdp2_eightbit`: in one pass on the local
        shards); any other optimizer steps through :class:`~lightning_mp.distributed.fsdp2_generic.ShardedGenericStep`.

        Raises:
            ValueError: SGD with dampening, a parameter that is not the model's, one that is not sharded (8-bit Adam,
                generic path), or torchao's quantised state with whole-file checkpoints.
        """
        if self._module is None:
            raise RuntimeError("ShardedRemainderMasters.attach() needs convert(module) first.")
        self._optimizers = list(optimizers)
        module_params = {id(p) for p in self._module.parameters()}
        for index, optimizer in enumerate(self._optimizers):
            entry = entry_for(optimizer)
            refused = (
                [(g, entry.sharded_refusal(group)) for g, group in enumerate(optimizer.param_groups)] if entry else []
            )
            refused = [(g, why) for g, why in refused if why is not None]
            if refused:
                raise ValueError(
                    f"master_weights='remainder' under FSDP2 does not support {refused[0][1]} (optimizer {index}, "
                    f"param_groups {[g for g, _ in refused]}): its state is made before the first step, for "
                    "distributed checkpoints, and a zero momentum buffer matches torch's first step only without "
                    "dampening. Use dampening=0, or master_weights=True under FSDP2."
                )
            check_params_belong(index, optimizer, module_params)
            step = self.updates.of(optimizer).generic
            if step is None:  # the table's: its fp32 state made now (a distributed-checkpoint load needs it)
                initial_state(optimizer)
            elif isinstance(step, ShardedAdam8bitStep):  # torchao's 8-bit Adam in one pass: its state made now
                step.initial_state()
            else:  # any other optimizer: on DTensor proxies of the shards, its state keyed by them
                continue
            if id(optimizer) not in self._optimizer_hooks:  # attach() again (optimizers followed): registered once
                self._optimizer_hooks[id(optimizer)] = keep_fp32_state(optimizer)

    # ------------------------------------------------------------------ the layout the chunked step reads
    def flat_slices(self, device: torch.device, start: int, end: int) -> tuple[Tensor, Tensor]:
        """Elements ``[start, end)`` of the virtual flat layout: a range inside one shard (chunks never span two)."""
        param = self._at[bisect_right(self._starts, start) - 1]
        _, offset = self._layout[id(param)]
        _, _, low = self._shards[id(param)]
        return local_of(param).view(-1)[start - offset : end - offset], low.view(-1)[start - offset : end - offset]

    @property
    def flat_buffers(self) -> list[tuple[Tensor, Tensor]]:
        """Empty: the bf16 shards are FSDP2's storages, one per parameter (see :attr:`remainders`)."""
        return []

    @property
    def remainders(self) -> dict[int, Tensor]:
        """``id(sharded parameter) -> int16 remainder of this rank's local shard``."""
        return {key: low for key, (_, _, low) in self._shards.items()}

    #: the generic path's step: on DTensor proxies of the local shards
    generic_step = ShardedGenericStep
    #: torchao's 8-bit Adam: in one pass on the local shards (:mod:`~lightning_mp.distributed.fsdp2_eightbit`)
    eight_bit_step = ShardedAdam8bitStep

    @staticmethod
    def _widen_grad(grad: Tensor) -> None:
        """A sharded gradient becomes fp32 through its local shard (FSDP2 adds the next reduced one into it)."""
        _retype_dtensor(grad, local_of(grad).float())

    @staticmethod
    def _total_norm(norms: list[Tensor], norm_type: float) -> Tensor:
        """The total norm over every rank's shards (``clip_grad_norm_``'s, computed in fp32): DTensor norms are
        partial, and ``full_tensor`` is the collective; a plain tensor, the same on every rank."""
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        return total.full_tensor() if hasattr(total, "full_tensor") else total

    # ------------------------------------------------------------------ checkpoint and teardown
    def fp32_value(self, param: Tensor) -> Tensor:
        """The exact fp32 value of a converted sharded parameter: a new fp32 ``DTensor`` sharded like it."""
        shard = self._shards.get(id(param))
        if shard is None:
            return super().fp32_value(param)
        from torch.distributed.tensor import DTensor

        joined = join_fp32(local_of(param), shard[2])
        sharded = cast(DTensor, param)  # a converted parameter is one of FSDP2's sharded ones: a DTensor
        return DTensor.from_local(
            joined, sharded.device_mesh, sharded.placements, run_check=False, shape=param.shape, stride=param.stride()
        )

    def load_fp32(self, param: nn.Parameter, value: Any) -> None:
        """A load brought ``value`` (a DTensor, a full tensor or any tensor-like) for ``param``: this rank's shard of
        it is split into the bf16 shard and its remainder, exactly."""
        shard = self._shards.get(id(param))
        if shard is None:
            return super().load_fp32(param, value)
        local = local_of(param)
        if not isinstance(value, Tensor):  # a tensor-like (LitGPT's NotYetLoadedTensor): read it once
            value = materialise(value, value.shape, local.device)
        self._split(_local_shard_of(value, param).to(local.device), local, shard[2])

    def follow_write(self, param: nn.Parameter, value: Optional[Tensor]) -> int:
        """A write in place into the bf16 shard: its remainder becomes zero (the written bf16 value is the value;
        which elements changed cannot be told, as on one device). Returns how many values were taken at 16 bits."""
        shard = self._shards.get(id(param))
        if shard is None:
            return super().follow_write(param, value)
        shard[2].zero_()
        return shard[2].numel()

    def restore(self) -> None:
        """Give FSDP2 fp32 shards again holding the exact values (a later forward all-gathers them in the policy's
        ``param_dtype``); optimizer state stays keyed by the same parameters. Hooks and remainders are released."""
        from torch.distributed.fsdp import FSDPModule

        error = self.stop_following()  # raised once the shards hold their exact values again
        for owner in self._module.modules() if self._module is not None else ():
            if isinstance(owner, FSDPModule):
                owner.reshard()  # after a forward without backward (validation) the root holds unsharded parameters
        with torch.no_grad():
            for key, (fsdp_param, group, low) in self._shards.items():
                param = self._params[key]
                _swap_shard(fsdp_param, group, local_of(param), torch.float32, partial(_join_into, low=low))
                if param.grad is not None and param.grad.dtype != torch.float32:  # a gradient left by the last step
                    _retype_dtensor(param.grad, local_of(param.grad).float())
            _retype_groups([group for _, group, _ in self._shards.values()])
        self.updates.release()  # the generic path's state back to whole shards, the staging buffers freed
        for hook in [h for hooks in self._optimizer_hooks.values() for h in hooks] + self._forward_hooks:
            hook.remove()
        self._reset()
        if error is not None:
            raise error

    def __repr__(self) -> str:
        held = sum(local_of(p).numel() for p in self._params.values())
        return (
            f"{type(self).__name__}(sharded bf16 weights + 16-bit remainders: {len(self._shards)} shards / {held} "
            f"local values, chunk_size={self.chunk_size}, accumulate_grads_in={self.accumulate_grads_in})"
        )


def _swap_shard(fsdp_param: Any, group: Any, local: Tensor, dtype: torch.dtype, fill: Any) -> Tensor:
    """Give ``fsdp_param`` a new padded storage of ``dtype`` whose local shard ``fill(local, shard)`` writes; the
    sharded parameter (same object) becomes a ``DTensor`` of that dtype viewing it. Returns the new local shard.
    Once every parameter of an already initialised ``group`` is swapped, call :func:`_retype_groups`."""
    param = fsdp_param.sharded_param
    padded = torch.zeros(fsdp_param.padded_sharded_param_size, dtype=dtype, device=local.device)
    if getattr(fsdp_param, "pin_memory", False):
        padded = padded.pin_memory()
    dim = fsdp_param.fsdp_placement.dim
    shard = padded.narrow(dim, 0, local.size(dim) if local.numel() > 0 else 0)
    fill(local, shard)
    _retype_dtensor(param, shard)
    fsdp_param._sharded_param_data = padded.view(-1)
    fsdp_param.reset_sharded_param()
    if hasattr(group, "_orig_dtype"):  # FSDP2 already ran (a fit before): its all-gather buffers (and dtypes, below)
        fsdp_param.all_gather_outputs = []
        if hasattr(fsdp_param, "_unsharded_param"):
            del fsdp_param._unsharded_param
    return shard


def _retype_groups(groups: list[Any]) -> None:
    """FSDP2 groups that already ran: their dtypes again, from their parameters' new ones."""
    for group in {id(g): g for g in groups}.values():
        if hasattr(group, "_orig_dtype"):
            group._init_mp_dtypes()


def _join_into(high: Tensor, out: Tensor, low: Tensor) -> None:
    join_fp32(high, low, out)


def _retype_dtensor(tensor: Any, local: Tensor) -> None:
    """Make ``tensor`` (a ``DTensor``, same object) view ``local``, whose dtype may differ from its own."""
    from torch.distributed.tensor import DTensor

    tensor.data = DTensor.from_local(
        local, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
    )
    tensor._local_tensor = local  # `.data` updates the wrapper's metadata, not the Python attribute


def _local_shard_of(value: Tensor, param: Tensor) -> Tensor:
    """This rank's fp32 shard of a loaded value: a DTensor's local shard, or the shard of a full tensor."""
    if hasattr(value, "to_local"):
        return local_of(value).detach().to(torch.float32, copy=True)
    if tuple(value.shape) == tuple(local_of(param).shape) != tuple(param.shape):
        return value.detach().to(torch.float32, copy=True)
    from torch.distributed.tensor import distribute_tensor

    whole = value.detach().to(local_of(param).device, torch.float32)
    sharded = cast("DTensor", param)  # a converted parameter is one of FSDP2's sharded ones: a DTensor
    return local_of(distribute_tensor(whole, sharded.device_mesh, sharded.placements, src_data_rank=None)).clone()
