"""fp32 master weights for a model held in fp16/bf16, independent of any trainer.

The model's parameters become half precision; the optimizer updates fp32 *master* copies kept in one flat
contiguous buffer per device (each master is a view into it, and so is its ``.grad``). Per step:
``grads_to_masters`` after every backward (accumulating in fp32 and freeing the half gradients; the model then shows
the masters' fp32 gradients as its own ``p.grad``, where Lightning's built-in precision has them),
``masters_to_model`` after the optimizer step. ``restore`` puts the fp32 values back into the model.

Both moves are one foreach op per device whatever the number of parameters, over lists made at setup
(:mod:`~lightning_mp.master.flat_moves`). The write-back's ``.data`` aliases hold the storage each parameter had
when they were made: they are made again when the model sync records a new storage (``p.data = t`` followed, a
load that gave new storage), which costs nothing per step; before the sync starts (the store used alone), the
storage addresses are compared at each write-back instead.

Memory at rest, per half-precision parameter with Adam: 2 (half weight) + 4 (master) + 4 (master grad)
+ 8 (Adam's two moments) = 18 bytes; the half gradient (2 bytes) lives only between a backward and the
move that follows it, and the gradient the model shows is the master's (no copy). Parameters kept in fp32
(normalisation layers by default) cost what they cost in fp32 training: 4 + 4 + 8 = 16 bytes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mp.master.converted import NORM_TYPES, ConvertedModel, is_norm, take_changed
from lightning_mp.master.flat_moves import FlatMoves

__all__ = ["NORM_TYPES", "MasterWeights", "is_norm"]


class MasterWeights(ConvertedModel):
    """Casts a module to ``dtype`` and keeps fp32 masters of the parameters its optimizers train.

    Args:
        dtype: ``torch.float16`` or ``torch.bfloat16``, the dtype the model runs in.
        keep_fp32: ``keep_fp32(qualified_name, module)`` is true for modules whose own parameters and
            buffers stay fp32 (default: :func:`is_norm`), and with them those of every module inside them (the
            policy runs such a module's whole subtree in fp32). Their parameters are trained as they are.
        show_grads: after each move the model's half parameters show their masters' fp32 gradients as their own
            ``p.grad`` (:mod:`~lightning_mp.master.flat_moves`), where Lightning's built-in precision has them. It
            needs :meth:`before_backward` before every backward (what code did to the shown gradients, and an
            ``optimizer.zero_grad()``, are followed there), which the plugin calls: ``masters_for`` (the plugin's
            store) turns it on. Default ``False``: the half gradients are freed by the move and ``p.grad`` is
            ``None``, as a plain loop of ``backward``, :meth:`grads_to_masters`, ``step``, ``zero_grad`` expects.

    After :meth:`convert`, :attr:`model_sync` (a :class:`~lightning_mp.master.model_sync.ModelSync`) keeps the masters
    equal to whatever writes the model: loads into any submodule at once, other writes once started
    (``model_sync.start()``, which the plugin calls at the end of its setup) at each ``model_sync.follow()``.
    """

    option: Any = True
    groups_hold_masters = True  # attach() swaps the fp32 masters into the optimizers' groups
    moves_grads = True  # the half gradients move to the masters; the masters' are shown as the model's

    def __init__(
        self, dtype: torch.dtype, keep_fp32: Callable[[str, nn.Module], bool] = is_norm, show_grads: bool = False
    ) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype={dtype} is not supported for master weights: use torch.float16 or torch.bfloat16.")
        self.show_grads = show_grads
        super().__init__(dtype, keep_fp32)

    def _reset(self) -> None:
        super()._reset()
        self._masters: dict[int, nn.Parameter] = {}  # id(half model param) -> its fp32 master
        self._param_of_master: dict[int, nn.Parameter] = {}  # id(master) -> half model param
        self._grad_views: dict[int, Tensor] = {}  # id(master) -> its slice of the flat grad buffer
        self._flat: list[list[Tensor]] = []  # one [flat masters, flat grads] per device (the moves may renew the grads)
        self._moves = FlatMoves(self.show_grads)  # the per-step moves' lists, per device
        self._carried_grads: dict[int, Tensor] = {}  # id(half param) -> its released master's gradient, until remade

    # ------------------------------------------------------------------ setup
    def _cast_param(self, param: nn.Parameter) -> None:
        # the model's parameter becomes half precision; its fp32 value is kept (no copy) until attach() or restore()
        if param.dtype != self.dtype:
            self._fp32_values[id(param)] = param.data
            param.data = param.data.to(self.dtype)

    def attach(self, optimizers: Iterable[Optimizer]) -> None:
        """Replace the half parameters inside each optimizer's ``param_groups`` by fp32 masters, in place.

        Param-group options and any optimizer state are kept; fp32 parameters stay as they are. LR schedulers
        keep pointing at the same optimizer objects.

        Raises:
            ValueError: an optimizer holds a parameter that is not in the converted module.
        """
        if self._module is None:
            raise RuntimeError("MasterWeights.attach() needs convert(module) first.")
        self._optimizers = list(optimizers)
        module_params = {id(p) for p in self._module.parameters()}
        trained: dict[int, nn.Parameter] = {}
        for index, optimizer in enumerate(self._optimizers):
            for g, group in enumerate(optimizer.param_groups):
                for i, param in enumerate(group["params"]):
                    if id(param) not in module_params and id(param) not in self._param_of_master:
                        raise ValueError(
                            f"master_weights=True needs every optimizer parameter to belong to the model, but "
                            f"optimizer {index} ({type(optimizer).__name__}) param_groups[{g}]['params'][{i}] "
                            f"(shape {tuple(param.shape)}, {param.dtype}) is not one of its parameters. Build the "
                            "optimizer from self.parameters() in configure_optimizers, or use master_weights=False."
                        )
                    if id(param) in self._params and id(param) not in self._masters:
                        trained[id(param)] = param
        self._build_masters(list(trained.values()))
        for optimizer in self._optimizers:
            for group in optimizer.param_groups:
                group["params"] = [self._masters.get(id(p), p) for p in group["params"]]
            for param in trained.values():
                if param in optimizer.state:
                    optimizer.state[self._masters[id(param)]] = optimizer.state.pop(param)
            refuse_twice(optimizer)
        self._record_groups()
        self._moves.forget_write_backs()  # the groups changed: the write-back lists are made again

    def follow_groups(self) -> None:
        """Follow param groups added since :meth:`attach` (``optimizer.add_param_group`` during fit: Lightning's
        ``BackboneFinetuning``, a callback): the new half parameters get masters (their exact fp32 values, kept
        since the cast) and the groups hold those, whatever edited them (:func:`~.following.seen`: a few identity
        checks per group); runs before every backward and before the gradients move to the masters.

        Raises:
            ValueError: a new parameter is not the model's, or its master is in the optimizer already.
            RuntimeError: a new half parameter under several processes (each rank's master would be its own).
        """
        if self._module is None or not self._groups_changed():
            return
        new = any(id(p) in self._params for o in self._optimizers for g in o.param_groups for p in g["params"])
        if new and several_processes():
            raise RuntimeError(
                "master_weights=True cannot follow optimizer.add_param_group after setup under several "
                "processes: the new parameters' masters would start from each rank's own values, outside the "
                "buffers the plugin reduces. Put every parameter in the optimizer in configure_optimizers "
                "(frozen ones included: they are left alone while they have no gradient), or use "
                "master_weights='remainder'."
            )
        self.attach(self._optimizers)

    def follow_optimizers(self, optimizers: Iterable[Optimizer]) -> None:
        """The run steps ``optimizers`` now (swapped mid-fit): those no longer in it get the model's parameters back
        (with their state), ``optimizers`` get masters as :meth:`attach` gives them. Masters no longer trained are
        released (their exact values kept as the parameters' fp32 values; the others made again in new flat buffers,
        gradients included); while the same parameters are trained, the masters stay (DDP's reduction with them).
        Raises as :meth:`attach`; a RuntimeError for masters to release under several processes."""
        optimizers, kept = list(optimizers), {id(optimizer) for optimizer in optimizers}
        self._moves.follow_shown_grads()  # the gradients the model shows agree with the masters' before they move
        for optimizer in self._optimizers:
            if id(optimizer) not in kept:
                self._give_back(optimizer)
        trained = {
            id(self._param_of_master.get(id(p), p)) for o in optimizers for g in o.param_groups for p in g["params"]
        }
        if any(key not in trained for key in self._masters):
            if several_processes():
                raise RuntimeError(
                    "master_weights=True cannot release the masters of parameters a new optimizer does not train "
                    "under several processes: the strategy reduces the flat buffers it was set up with. Build the "
                    "new optimizer over the same parameters (frozen ones too), or use master_weights='remainder'."
                )
            for optimizer in optimizers:
                self._give_back(optimizer)
            for key, master in self._masters.items():  # the exact values and gradients, for the masters made again
                self._fp32_values[key] = master.detach().clone()
                if master.grad is not None:
                    self._carried_grads[key] = master.grad.detach().clone()
            self._moves.hide_grads()  # shown again from the masters made again; not shown where none is made
            self._masters, self._param_of_master, self._grad_views, self._flat = {}, {}, {}, []
            self._moves = FlatMoves(self.show_grads)
        self._optimizers = []
        self.attach(optimizers)
        self._carried_grads = {}  # those of masters not made again: not trained any more

    def _give_back(self, optimizer: Optimizer) -> None:
        """``optimizer``'s groups and state hold the model's parameters again instead of their masters."""
        for group in optimizer.param_groups:
            group["params"] = [self._param_of_master.get(id(p), p) for p in group["params"]]
        for master in [m for m in optimizer.state if id(m) in self._param_of_master]:
            optimizer.state[self._param_of_master[id(master)]] = optimizer.state.pop(master)

    def _build_masters(self, params: list[nn.Parameter]) -> None:
        by_device: dict[torch.device, list[nn.Parameter]] = defaultdict(list)
        for param in params:
            by_device[param.device].append(param)
        for device, group in by_device.items():
            flat = torch.empty(sum(p.numel() for p in group), dtype=torch.float32, device=device)
            flat_grad = torch.zeros_like(flat)
            offset = 0
            for param in group:
                end = offset + param.numel()
                view = flat[offset:end].view_as(param)
                view.copy_(self._fp32_values.pop(id(param), param.data))  # exact fp32 values where we have them
                master = nn.Parameter(view, requires_grad=param.requires_grad)
                self._masters[id(param)] = master
                self._param_of_master[id(master)] = param
                self._grad_views[id(master)] = flat_grad[offset:end].view_as(param)
                self._moves.add(param, master, self._grad_views[id(master)])
                carried = self._carried_grads.pop(id(param), None)
                if carried is None:  # a gradient the parameter holds now (a second fit's, a group added after a
                    carried = param.grad  # backward) is its master's, as the model's gradient is the master's
                if carried is not None:  # masters made again (follow_optimizers): their gradients come along
                    master.grad = self._grad_views[id(master)].copy_(carried)
                offset = end
            self._flat.append([flat, flat_grad])
            self._moves.add_buffer(device, self._flat[-1], len(group))
        self._moves.show_grads()  # the model shows its masters' gradients (flat_moves)

    # ------------------------------------------------------------------ per step
    def pairs(self) -> Iterator[tuple[nn.Parameter, nn.Parameter]]:
        """``(half model parameter, fp32 master)`` for every trained half parameter."""
        for key, master in self._masters.items():
            yield self._params[key], master

    def before_backward(self) -> None:
        """Called before every backward: param groups added since the last step get masters (:meth:`follow_groups`;
        the half gradients move to the masters after it), and what code did to the gradients the model shows is
        followed (:meth:`follow_shown_grads`)."""
        self.follow_groups()
        self._moves.follow_shown_grads()

    def grads_to_masters(self) -> None:
        """Move the half gradients into the masters' fp32 ``.grad`` (adding to what is there) and free them (groups
        added since the backward began followed first): one foreach op per device (:class:`FlatMoves`). The model
        then shows the masters' gradients as its own ``p.grad`` (views of them: no copy)."""
        self.follow_groups()
        self._moves.grads_to_masters()

    def follow_shown_grads(self) -> None:
        """The masters' gradients follow what code did to the gradients the model shows (set to ``None``, another
        tensor assigned; in-place writes reach them by themselves), and the model shows no gradient where
        ``optimizer.zero_grad()`` freed the master's: :meth:`FlatMoves.follow_shown_grads`."""
        self._moves.follow_shown_grads()

    def hide_grads(self) -> None:
        """The model shows no gradient until the next move (the masters keep theirs): before a backward whose half
        gradients must be new tensors of the parameters' dtype (DDP's buckets)."""
        self._moves.hide_grads()

    def ensure_grads(self) -> None:
        """Give every trainable master a gradient (its slice of the flat buffer, zeroed) where no backward produced
        one, so that a collective over the flat gradient buffers (DDP) reduces defined values on every rank."""
        for master in self._masters.values():
            if master.requires_grad and master.grad is None:
                grad = self._grad_views[id(master)]
                grad.zero_()
                master.grad = grad
        self._moves.show_grads()

    def masters_to_model(self, optimizer: Optimizer) -> None:
        """Copy the masters that ``optimizer`` updates back into the half model parameters: one ``_foreach_copy_``
        per device into ``.data`` aliases, which bumps no version counter (not a write the model sync follows)."""
        self._moves.masters_to_model(optimizer, self._param_of_master, self._storage_key())

    def _storage_key(self) -> Any:
        """What tells whether the write-back's ``.data`` aliases still hold the parameters' storage: the model sync's
        storage generation once it follows writes (free), else the storage addresses themselves (read each call)."""
        sync = self.model_sync
        if sync is not None and sync.started:
            return sync.storage_generation
        return tuple(map(Tensor.data_ptr, self._params.values()))

    def step(self, optimizer: Optimizer, found_inf: Optional[Tensor], run: Optional[Callable[[], Any]]) -> Any:
        """The optimizer's own step on the fp32 masters (``run``), then the masters back into the model (a skipped
        step copies back the unchanged values)."""
        assert run is not None
        output = run()
        self.masters_to_model(optimizer)
        return output

    def master_of(self, param: Tensor) -> Optional[nn.Parameter]:
        """The fp32 master of a half model parameter (``None`` if it has none)."""
        return self._masters.get(id(param))

    @property
    def flat_buffers(self) -> list[tuple[Tensor, Tensor]]:
        """``(flat fp32 masters, flat fp32 grads)``, one pair per device."""
        return [(flat, flat_grad) for flat, flat_grad in self._flat]

    # ------------------------------------------------------------------ checkpoint and teardown
    def fp32_value(self, param: Tensor) -> Tensor:
        """The full-precision value of a converted parameter: its master, its pre-cast value, or an upcast."""
        master = self._masters.get(id(param))
        return master.detach() if master is not None else self._kept_value(param)

    # ------------------------------------------------------------------ writes into the model (ModelSync calls these)
    def load_fp32(self, param: nn.Parameter, value: Any) -> None:
        """A load brought ``value`` (any tensor-like) for ``param``: the master becomes it exactly, the model its
        rounding (whichever alias of a tied parameter torch copied last)."""
        if tuple(value.shape) != tuple(param.shape):
            return  # torch reports the size mismatch
        master = self._masters.get(id(param))
        if master is None:  # before attach(), or not trained: kept until attach() or restore()
            return self._load_kept(param, value)
        master.copy_(value)
        self._round_into(param, master)

    def follow_write(self, param: nn.Parameter, value: Optional[Tensor]) -> int:
        """``param`` was written outside the plugin's step: the master becomes the value now in the model.
        ``value``: a new value (a replacement's, or new storage: fp32 or half, same shape and device), taken whole, or
        ``None`` for a write in place: the model held each master's rounding, so an element whose 16-bit value the
        write left as it was keeps its exact master, and a changed one becomes the model's 16-bit value. Returns how
        many values were taken at 16-bit precision (0 for a new value)."""
        master = self._masters.get(id(param))
        if master is None:
            return self._follow_kept(param, value)
        if value is None:
            return take_changed(master, param.detach())
        master.copy_(value.detach())
        param.data = value.detach().to(self.dtype, copy=True)  # a copy: no storage shared with the tensor written
        return 0

    def restore(self) -> None:
        """Give the model back its fp32 values and the optimizers back the model's parameters (with their
        state). The masters, their flat buffers and the half copies are released; the fp32 gradients the model shows
        stay its gradients, as the built-in's fp32 model keeps its own after fit. Writes since the last step are
        followed first (one that cannot be is raised once the model holds its fp32 values)."""
        self._moves.follow_shown_grads()  # none shown where optimizer.zero_grad() freed the masters'
        error = self.stop_following()
        for key, param in self._params.items():
            if key in self._masters:  # a fresh tensor, not a view that would keep the flat buffer alive
                param.data = self._masters[key].detach().to(param.device, copy=True)
            else:
                param.data = self.fp32_value(param).to(param.device)
        self._restore_buffers()
        for optimizer in self._optimizers:
            self._give_back(optimizer)
        self._reset()
        if error is not None:
            raise error

    def __repr__(self) -> str:
        trained = sum(m.numel() for m in self._masters.values())
        return f"{type(self).__name__}(dtype={self.dtype}, masters={len(self._masters)} tensors / {trained} values)"


def refuse_twice(optimizer: Optimizer) -> None:
    """Raise when a master is in ``optimizer``'s groups twice (a model parameter added again after setup, while its
    master is in the optimizer already: torch's own check compares the objects, which differ)."""
    seen: set[int] = set()
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            if id(param) in seen:
                raise ValueError(
                    f"{type(optimizer).__name__}.param_groups[{g}]['params'][{i}] (shape {tuple(param.shape)}) is "
                    "in the optimizer twice: it was added again after setup while master_weights=True had already "
                    "put its fp32 master in the optimizer. Add only parameters that are not in the optimizer yet."
                )
            seen.add(id(param))


def several_processes() -> bool:
    """Whether a process group of more than one process runs (masters made after setup would differ per rank)."""
    return (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )
