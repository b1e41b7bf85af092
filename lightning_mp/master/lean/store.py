"""Lean master weights: a bf16 model plus a 16-bit remainder per element, that together are the fp32 masters exactly.

``master_weights="remainder"``. The model's parameters become bf16 views into flat blocks (what the forward uses;
:mod:`lightning_mp.master.lean.blocks`); a parallel int16 buffer holds, per element, the low 16 bits that the bf16
rounding dropped (see :mod:`lightning_mp.kernels.bits`: every non-NaN fp32 value is its bf16 half plus this
remainder, bit for bit). No fp32 copy of the model exists between steps; the step (:meth:`~RemainderMasters.step`)
joins them in one pass (:mod:`~lightning_mp.master.lean.plan`) or one chunk at a time.

Memory at rest per trained bf16 parameter with AdamW: 2 (bf16 weight) + 2 (remainder) + 2 (bf16 gradient, between
a backward and the step) + 8 (two fp32 moments) = 14 bytes, against 16 for an fp32 model and 18 for
``master_weights=True``. With 8-bit optimizer states (torchao ``AdamW8bit``): 2 + 2 + 2 + ~2 = ~8 bytes. Gradient
accumulation over several micro-batches adds up in fp32 by default (exact: 4 bytes per parameter while
accumulating, instead of 2), or in bf16 with ``accumulate_grads_in=torch.bfloat16`` (lossy: each micro-batch's sum
is rounded to bf16).

Parameters kept in fp32 (normalisation layers by default, the cast policy's ``fp32_modules``) get no remainder:
they are updated in place in fp32, as in fp32 training.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mp.kernels.bits import JoinSplit
from lightning_mp.master.converted import ConvertedModel, is_norm
from lightning_mp.master.following import Generation, seen
from lightning_mp.master.lean.blocks import Blocks, join_by_chunks, split_by_chunks
from lightning_mp.master.lean.chunked import FUSED_UNIT
from lightning_mp.master.lean.clipping import norm_and_factor
from lightning_mp.master.lean.eightbit import Adam8bitStep
from lightning_mp.master.lean.generic import GenericChunkedStep
from lightning_mp.master.lean.optimizer_state import check_params_belong, keep_fp32_state
from lightning_mp.master.lean.plan import Plans
from lightning_mp.master.lean.update import Updates
from lightning_mp.master.model_sync import materialise

#: Default chunk per device type: 2**18 elements on CPU (3 MiB of fp32 transients per step: the eager join and split
#: stay in cache; measured in benchmarks/lean_step.py), 2**25 on GPUs (384 MiB: a chunk's dozen kernel launches must
#: not outweigh the bytes it moves).
DEFAULT_CHUNK_SIZES = {"cpu": 1 << 18, "cuda": 1 << 25}


class RemainderMasters(ConvertedModel):
    """A bf16 model whose fp32 masters are kept as bf16 weights plus 16-bit remainders; fused, chunked updates.

    Storage only, beside :class:`~lightning_mp.master.MasterWeights` (their common base:
    :class:`~lightning_mp.master.converted.ConvertedModel`): the weights interface
    (:class:`~lightning_mp.master.plain.PlainWeights`) over the blocks. No fp32 master tensor exists, so
    :meth:`~lightning_mp.master.plain.PlainWeights.pairs`, ``master_of`` and ``grads_to_masters`` keep the
    interface's answers (none, ``None``, nothing to move): the gradients stay on the parameters.

    Args:
        dtype: must be ``torch.bfloat16`` (bf16 is the top half of an fp32; fp16 is not, so no 16-bit remainder
            can complete it: use ``master_weights=True`` for fp16).
        keep_fp32: ``keep_fp32(qualified_name, module)`` is true for modules whose own parameters and buffers stay
            fp32 (default: :func:`~lightning_mp.master.is_norm`). They are trained in fp32, without remainder.
        chunk_size: elements per chunk of the update (a multiple of 32768; default ``None``: 2**18 on CPU, 2**25
            on a GPU): the step's transient memory is about 12 bytes x ``chunk_size``
            (:mod:`lightning_mp.master.lean.chunked`).
        accumulate_grads_in: dtype in which gradients of several backwards before one step add up:
            ``torch.float32`` (default, exact, 4 bytes per parameter while accumulating) or ``torch.bfloat16``
            (2 bytes, each sum rounded to bf16).
        compile: ``True`` compiles the split of each chunk back into bf16 + remainder with ``torch.compile`` (one
            loop instead of about ten eager passes; the first step compiles, which needs a C++ compiler on CPU).
            The update's arithmetic is torch's fused kernel either way, so the results are the same bits. Default
            ``False``.

    The optimizers of the table (:mod:`lightning_mp.master.lean.optimizers`: ``torch.optim.AdamW``, ``Adam``, ``SGD``,
    ``NAdam``) are updated on the lean state bitwise as torch's fused (or foreach) optimizer would update fp32
    parameters holding the exact values. Any other optimizer runs on fp32 slices of the parameters, chunk by chunk
    (:mod:`lightning_mp.master.lean.generic`); :mod:`lightning_mp.master.lean.update` chooses.
    """

    kind = option = "remainder"
    updates_itself = lean = True  # its step (fused_step) updates the weights and takes the found-inf flag
    tells_changed_values = False  # the remainders complete the bf16 weights a write in place overwrites

    def __init__(
        self,
        dtype: torch.dtype = torch.bfloat16,
        keep_fp32: Callable[[str, nn.Module], bool] = is_norm,
        chunk_size: Optional[int] = None,
        accumulate_grads_in: torch.dtype = torch.float32,
        compile: bool = False,
    ) -> None:
        if dtype != torch.bfloat16:
            raise ValueError(
                f"master_weights='remainder' needs precision='bf16-mixed', not {dtype}: a bf16 value is the top half "
                "of an fp32 one, so 16 more bits complete it exactly; an fp16 value is not (other exponent and "
                "mantissa widths), so no 16-bit remainder can. Use master_weights=True (fp32 masters) with fp16, or "
                "precision='bf16-mixed' with master_weights='remainder'."
            )
        if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size <= 0 or chunk_size % FUSED_UNIT):
            raise ValueError(f"chunk_size={chunk_size!r} must be a positive multiple of {FUSED_UNIT}.")
        if accumulate_grads_in not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"accumulate_grads_in={accumulate_grads_in!r} must be torch.float32 (exact) or torch.bfloat16."
            )
        if not isinstance(compile, bool):
            raise ValueError(f"compile={compile!r} must be True or False.")
        self.chunk_size, self.accumulate_grads_in, self.compile = chunk_size, accumulate_grads_in, compile
        self.codec = JoinSplit(compile)  # the join and split of the chunked and generic paths
        super().__init__(dtype, keep_fp32)

    def _reset(self) -> None:
        super()._reset()
        self.step_plans: dict[int, Any] = (
            Plans()
        )  # the one-pass update's plans (master/lean/plan.py), made at the first step
        self._blocks = Blocks(self.chunk_size_for, on_release=self._drop_plans)  # the bf16 weights and remainders
        self._layout = self._blocks.layout  # id(param) -> (device, offset in the flat buffers)
        self._pending: list[nn.Parameter] = []  # converted parameters not yet in a block
        self._grad_ops: dict[int, list[tuple[str, Any]]] = {}  # id(optimizer) -> clipping to apply at the step
        self.updates = Updates(self)  # each optimizer's update, its path chosen once (master/lean/update.py)
        self._optimizer_hooks: dict[int, list[Any]] = {}  # id(optimizer) -> its load_state_dict hooks

    # ------------------------------------------------------------------ setup
    def convert(self, module: nn.Module) -> nn.Module:
        """Make ``module``'s parameters bf16 views into blocks of bf16 weights and remainders, one parameter at a time,
        releasing each fp32 value once split (so the model never exists twice); see :meth:`ConvertedModel.convert
        <lightning_mp.master.converted.ConvertedModel.convert>`."""
        super().convert(module)
        pending, self._pending = self._pending, []
        self._blocks.split_in(pending)
        return module

    def _drop_plans(self) -> None:
        """Forget the step plans: each holds views of the blocks (and the state tensors) whose addresses it gave the
        kernel, so a plan kept past a block's release would keep that block's storage alive (at restore: every
        block at once, 4 bytes per parameter on top of the fp32 model). The next step lays out new ones."""
        self.step_plans.clear()

    def _cast_param(self, param: nn.Parameter) -> None:
        self._pending.append(param)  # split into its block after the walk (blocks are sized from the whole list)

    def attach(self, optimizers: Iterable[Optimizer]) -> None:
        """Prepare each optimizer; blocks whose parameters the strategy moved to another device since
        :meth:`convert` are rebuilt there (bf16 halves from the moved parameters, remainders copied over).

        The optimizers keep the model's (bf16) parameters in their ``param_groups``: nothing is swapped.

        Raises:
            ValueError: an optimizer holds a parameter that is not in the converted module.
        """
        if self._module is None:
            raise RuntimeError("RemainderMasters.attach() needs convert(module) first.")
        self._optimizers = list(optimizers)
        module_params = {id(p) for p in self._module.parameters()}
        for index, optimizer in enumerate(self._optimizers):
            check_params_belong(index, optimizer, module_params)
        self._blocks.relocate()
        if self.model_sync is not None:
            self.model_sync.record_storage()  # the plugin's own move: not a write
        for optimizer in self._optimizers:
            generic = self.updates.of(optimizer).generic  # its state keyed by the parameters: kept fp32 across loads
            keyed_by_params = generic is None or generic.whole_param_state
            if keyed_by_params and id(optimizer) not in self._optimizer_hooks:
                self._optimizer_hooks[id(optimizer)] = keep_fp32_state(optimizer)  # attach() again: registered once
        self._record_groups()

    def follow_optimizers(self, optimizers: Iterable[Optimizer]) -> None:
        """The run steps ``optimizers`` now (swapped mid-fit): those no longer in it are released (the generic path's
        state back to whole parameters, load hooks removed), the step plans made again, ``optimizers`` attached."""
        optimizers, kept = list(optimizers), {id(optimizer) for optimizer in optimizers}
        for optimizer in [o for o in self._optimizers if id(o) not in kept]:
            self.updates.forget(optimizer)
            for hook in self._optimizer_hooks.pop(id(optimizer), []):
                hook.remove()
        self.updates.replan()
        self.step_plans.clear()  # plans hold the old groups' and state's addresses: made again, never patched
        self.attach(optimizers)

    def follow_groups(self, optimizer: Optional[Optimizer] = None, now: Optional[Generation] = None) -> None:
        """Follow the groups edited since :meth:`attach` (:func:`~lightning_mp.master.following.seen`; ``now``:
        ``optimizer``'s generation, asked already): every converted parameter has its bf16 weight and remainder and
        the step reads the groups as they are; a new parameter must be the model's; an optimizer the table of
        :mod:`~lightning_mp.master.lean.optimizers` does not know makes the new groups' slices (``GenericChunkedStep``)."""
        for held, at in self._groups_at:  # none recorded: FSDP2's subclass, which follows nothing
            if (now.groups if now is not None and held is optimizer else seen(held).groups) != at:
                break
        else:
            return
        module_params = self._held_ids()
        for index, held in enumerate(self._optimizers):
            check_params_belong(index, held, module_params, during_fit=True)
            update = self.updates.get(held)
            if update is not None:
                update.follow_groups()
        self._record_groups()

    def _held_ids(self) -> set[int]:
        """Ids of the parameters a group may hold during fit: the module's, and the converted ones the store holds
        (a parameter the user replaced on the module, ``module.weight = nn.Parameter(...)``, is still the optimizer's
        until the model sync puts it back at the next update: it is not a stranger)."""
        assert self._module is not None
        return {id(p) for p in self._module.parameters()} | set(self._params)

    def check_trained(self, params: list[Tensor]) -> None:
        """Raise a ValueError naming the first of ``params`` that is not the converted module's: a step plan
        (:mod:`.plan`) asks when it lays out a group, so a parameter put in a group in place is checked first."""
        if self._module is None:
            return
        module_params = self._held_ids()
        for param in params:
            if id(param) not in module_params:
                raise ValueError(
                    f"master_weights='remainder' needs every optimizer parameter to belong to the model, but a "
                    f"parameter of shape {tuple(param.shape)} ({param.dtype}) in the optimizer's param_groups is not "
                    "one of its parameters (put there in place, e.g. group['params'].append(...)). Nothing was "
                    "updated. Add the model's own parameters (optimizer.add_param_group, or group['params'] edited "
                    "with the model's parameters), or use master_weights=False."
                )

    def chunk_size_for(self, device: torch.device) -> int:
        """The chunk size on ``device``: the one given, or the device type's default."""
        return self.chunk_size or DEFAULT_CHUNK_SIZES.get(device.type, DEFAULT_CHUNK_SIZES["cuda"])

    #: the generic path's step (any optimizer the table of master/lean/optimizers.py does not know)
    generic_step = GenericChunkedStep
    #: torchao's 8-bit Adam: in one pass (:mod:`~lightning_mp.master.lean.eightbit`)
    eight_bit_step: Optional[type[Any]] = Adam8bitStep

    # ------------------------------------------------------------------ per step
    def fp32_pairs(self) -> Iterator[tuple[nn.Parameter, Tensor]]:
        """``(bf16 model parameter, its exact fp32 value)``; each value is a fresh fp32 tensor (materialised)."""
        for key, param in self._params.items():
            if key in self._layout:
                yield param, self.fp32_value(param)

    def flat_slices(self, device: torch.device, start: int, end: int) -> tuple[Tensor, Tensor]:
        """Elements ``[start, end)`` of the flat bf16 weights and int16 remainders (offsets as :meth:`offset_of`
        gives them; a range never spans two blocks)."""
        return self._blocks.slices(start, end)

    def offset_of(self, param: Tensor) -> Optional[int]:
        """Where ``param`` starts in its device's flat buffers; ``None`` for a parameter without remainder."""
        place = self._layout.get(id(param))
        return place[1] if place is not None else None

    @property
    def layout_version(self) -> int:
        """Changes whenever blocks are made or released: older step plans (:mod:`.plan`) hold stale addresses."""
        return self._blocks.version

    @property
    def flat_buffers(self) -> list[tuple[Tensor, Tensor]]:
        """``(flat bf16 weights, flat int16 remainders)``, one pair per block (each on one device)."""
        return [block for block in self._blocks.blocks if block is not None]

    def before_backward(self) -> None:
        """Before every backward: forget clipping asked for since the last step (a skipped step leaves it behind),
        and make existing gradients fp32 (exact accumulation) unless ``accumulate_grads_in`` is bf16. Autograd then
        adds each new bf16 gradient into the fp32 one. Param groups added since the last step are followed."""
        self.follow_groups()
        self._grad_ops.clear()  # clipping asked for before a skipped step is stale: new gradients are coming
        if self.accumulate_grads_in != torch.float32:
            return
        for param in self._params.values():
            grad = param.grad
            if grad is not None and grad.dtype != torch.float32:
                self._widen_grad(grad)

    @staticmethod
    def _widen_grad(grad: Tensor) -> None:
        """Make the gradient ``grad`` fp32 in place (the same tensor object: autograd keeps adding into it)."""
        grad.data = grad.data.float()

    def clip_grad_norm_(
        self,
        optimizer: Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: Optional[bool] = None,
    ) -> Tensor:
        """Clip by the total norm, computed in fp32 as torch's on fp32 masters (:mod:`~lightning_mp.master.lean.clipping`),
        applied inside the step to the gradients' fp32 values (bf16 ones are not rounded twice); the total norm."""
        total, coef = norm_and_factor(optimizer, max_norm, norm_type, error_if_nonfinite, foreach, self._total_norm)
        if coef is not None:
            self._grad_ops.setdefault(id(optimizer), []).append(("mul", coef))
        return total

    @staticmethod
    def _total_norm(norms: list[Tensor], norm_type: float) -> Tensor:
        """The norm of the per-gradient ``norms`` (all on one device)."""
        return torch.linalg.vector_norm(torch.stack(norms), norm_type)

    def clip_grad_value_(self, optimizer: Optimizer, clip_value: float) -> None:
        """Clamp ``optimizer``'s gradients to ``[-clip_value, clip_value]``, in fp32, inside the step."""
        self._grad_ops.setdefault(id(optimizer), []).append(("clamp", float(clip_value)))

    def step(self, optimizer: Optimizer, found_inf: Optional[Tensor], run: Optional[Callable[[], Any]]) -> Any:
        """The lean update (:meth:`fused_step`), skipped where ``found_inf`` is 1; ``run`` is not called."""
        return self.fused_step(optimizer, found_inf)

    def fused_step(self, optimizer: Optimizer, found_inf: Optional[Tensor] = None) -> None:
        """The update of ``optimizer``'s parameters on the lean state, chunk by chunk.

        ``found_inf``: a 0-dim float tensor on the device, nonzero when the step must be skipped (weights,
        remainders, optimizer state and step counters stay unchanged; without any host synchronisation for
        AdamW/Adam/SGD, and for other optimizers where :mod:`~lightning_mp.master.lean.generic` can mask the step);
        ``None`` steps unconditionally. Clipping requested since the last step is applied here.
        """
        now = seen(optimizer, state=True)  # what the optimizer reads now: every cache of the update compares with it
        self.follow_groups(optimizer, now)  # a group added after backward (on_before_optimizer_step)
        grad_ops = self._grad_ops.pop(id(optimizer), [])
        # what torch's optimizer.step() records for LR schedulers, which warn on their first step without it
        optimizer._opt_called = True  # type: ignore[attr-defined]
        self.updates.of(optimizer, now).run(found_inf, grad_ops, now)  # one-pass, chunked or generic (update.py)

    # ------------------------------------------------------------------ checkpoint and teardown
    def fp32_value(self, param: Tensor) -> Tensor:
        """The exact fp32 value of a converted parameter (a fresh tensor): bf16 weight joined with its remainder."""
        place = self._layout.get(id(param))
        if place is not None:
            high, low = self.flat_slices(place[0], place[1], place[1] + param.numel())
            value = torch.empty(param.shape, dtype=torch.float32, device=high.device)
            return join_by_chunks(high, low, value.view(-1), self.chunk_size_for(high.device)).view(param.shape)
        return self._kept_value(param)

    def load_fp32(self, param: nn.Parameter, value: Any) -> None:
        """A load brought ``value`` (any tensor-like) for ``param``: split it exactly into the bf16 weight and its
        remainder, chunk by chunk (after torch copied it into the bf16 weight, rounding ties its own way)."""
        if tuple(value.shape) != tuple(param.shape):
            return  # torch reports the size mismatch
        place = self._layout.get(id(param))
        if place is None:  # not held in a block (not converted here): kept until restore
            return self._load_kept(param, value)
        if not isinstance(value, Tensor):  # a tensor-like (LitGPT's NotYetLoadedTensor): read it once, in fp32
            value = materialise(value, param.shape, place[0])
        high, low = self.flat_slices(place[0], place[1], place[1] + param.numel())
        split_by_chunks(value.detach().reshape(-1), high, low, self.chunk_size_for(place[0]))
        if param.data_ptr() != high.data_ptr():  # `param.data = tensor` before the load: the block again
            param.data = high.view_as(param)

    def follow_write(self, param: nn.Parameter, value: Optional[Tensor]) -> int:
        """``param`` was written outside the plugin's step: ``value`` (fp32 or bf16) is split into the block and the
        parameter views the block again, or, for a write in place (``value`` ``None``), the bf16 weight in the block
        holds the new value and its remainder becomes zero. The write overwrote the bf16 weights that the remainders
        complete, and nothing else holds them (a copy would cost 2 bytes/param): which elements it changed cannot be
        told, so the whole parameter is taken at 16-bit precision. Returns how many values were (0 for a new value);
        :func:`~lightning_mp.master.exact.exact_weights` writes exactly."""
        place = self._layout.get(id(param))
        if place is None:
            return self._follow_kept(param, value)
        high, low = self.flat_slices(place[0], place[1], place[1] + param.numel())
        if value is None:
            low.zero_()
            return param.numel()
        split_by_chunks(value.detach().reshape(-1), high, low, self.chunk_size_for(place[0]))
        param.data = high.view_as(param)
        return 0

    def restore(self) -> None:
        """Give the model back its exact fp32 values (fresh tensors), block by block, each block released once its
        parameters are fp32 (the model's weights then cost at most one block more than the fp32 model). The state of
        an optimizer of the table (:mod:`~lightning_mp.master.lean.optimizers`) stays keyed by the same parameters;
        see :meth:`GenericChunkedStep.restore` for others."""
        error = self.stop_following()  # while the blocks still hold the weights; raised once the model is fp32
        self.updates.release()  # the generic path's state back to whole parameters, the staging buffers freed
        for hooks in self._optimizer_hooks.values():
            for hook in hooks:
                hook.remove()
        with torch.no_grad():
            for index, members in enumerate(self._blocks.members):
                for param in members:
                    value = self.fp32_value(param)
                    del self._layout[id(param)]  # the parameter holds its exact value now
                    param.data = value
                self._blocks.release(index)
            for param in self._params.values():  # any other converted parameter: its kept value (none usually)
                param.data = self.fp32_value(param).to(param.device)
        self._restore_buffers()
        self._reset()
        if error is not None:
            raise error

    def __repr__(self) -> str:
        held = sum(p.numel() for key, p in self._params.items() if key in self._layout)
        return (
            f"{type(self).__name__}(bf16 weights + 16-bit remainders: {len(self._layout)} tensors / {held} values, "
            f"chunk_size={self.chunk_size}, accumulate_grads_in={self.accumulate_grads_in})"
        )
