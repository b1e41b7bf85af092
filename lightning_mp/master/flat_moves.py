"""The per-step moves of flat fp32 masters (:class:`~lightning_mp.master.MasterWeights`), each one foreach op per
device whatever the number of parameters, and the gradients the model shows.

The lists they run over are made once: the half parameters, their masters and the masters' gradient views at setup
(in one order, with the tensors the model shows as its gradients, which change), and for the write-back, per optimizer, ``.data``
aliases of the half parameters with the masters they take. ``.data`` aliases share the parameters' storage but not
their version counters, so the write-back is not a write that :mod:`~lightning_mp.master.model_sync` follows. An alias
points at the storage its parameter had when it was made: the caller passes a key that changes when a parameter's
storage may have changed (``p.data = t`` followed, a load that gave new storage), and the write-back lists are made
again then.

**The gradients the model shows** (``show=True``: the plugin's store; otherwise the move frees the half gradients and
``p.grad`` stays ``None``). After each backward the half gradients are added into the masters' fp32 gradients
and freed, and each half parameter whose master has a gradient shows that fp32 gradient as its own ``p.grad``: a
tensor whose data *is* the master's gradient view (no copy, no memory), so code
reads ``p.grad`` where Lightning's built-in precision has it (after ``manual_backward`` / ``fabric.backward``, in
``on_before_optimizer_step``, after the step), with the built-in's fp32 values: the accumulated sum, unscaled and
clipped in place where the masters' are. What code does to a shown gradient reaches the masters: an in-place write
(``clip_grad_norm_`` by hand, ``zero_()``) writes the master's gradient itself, and a backward outside the plugin's
hooks adds into it in fp32, as autograd adds into an existing gradient; a gradient set to ``None`` or replaced by
another tensor is followed at the next :meth:`FlatMoves.follow_shown_grads` (before every backward and every step),
and so are the masters' gradients freed by ``optimizer.zero_grad()``. A shown gradient is fp32 on a half parameter:
torch checks the dtype only when ``p.grad`` is assigned, so the half gradient autograd made becomes the shown one
(its ``.data`` replaced: no op), or a tensor is assigned while it holds the parameter's own data and given the
master's gradient right after.

Gradients freed and made again reuse the flat gradient buffer, unless code still holds a tensor on it (a gradient
kept from before ``zero_grad()``, as SAM keeps the first backward's): the masters' gradient views then move to a new
buffer and the old one stays with what holds it, as the built-in's freed gradients stay with whoever keeps them.
"""

from __future__ import annotations

import operator
import sys
from collections import defaultdict, deque
from collections.abc import Iterable
from itertools import compress, repeat
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

_grad_of = operator.attrgetter("grad")
_dtype_of = operator.attrgetter("dtype")
#: in the shown list where a parameter shows nothing of the store's (its earlier shown tensor let go)
_NOT_SHOWN = object()


class FlatMoves:
    """Per device, the lists the gradient move, the shown gradients and the write-back run over (the module doc)."""

    def __init__(self, show: bool = False) -> None:
        self.show = show  # whether the model shows the masters' gradients (else the move frees the half ones)
        # per device: (half model params, their masters, the masters' grad views, the tensors shown as the params'
        # gradients), in one order
        self.groups: dict[torch.device, tuple[list[nn.Parameter], list[nn.Parameter], list[Tensor], list[Any]]] = {}
        # per device: ([flat masters, flat grads] as the store keeps them, index of its first view, number of views)
        self._buffers: dict[torch.device, list[tuple[list[Tensor], int, int]]] = defaultdict(list)
        # id(optimizer) -> (storage key, [(model .data aliases, master values)] per device)
        self._write_backs: dict[int, tuple[Any, list[tuple[list[Tensor], list[Tensor]]]]] = {}
        self._hidden = False  # hide_grads() since the last move: new half gradients add to the masters'

    def add(self, param: nn.Parameter, master: nn.Parameter, grad_view: Tensor) -> None:
        """A half parameter, its master and the master's slice of the flat gradient buffer (at setup)."""
        params, masters, grad_views, shown = self.groups.setdefault(param.device, ([], [], [], []))
        params.append(param)
        masters.append(master)
        grad_views.append(grad_view)
        shown.append(_NOT_SHOWN)  # a tensor of its own once it shows its master's gradient

    def add_buffer(self, device: torch.device, buffers: list[Tensor], count: int) -> None:
        """``buffers`` (``[flat masters, flat grads]``, which the store lists as its flat buffers) holds the last
        ``count`` gradient views added on ``device``; ``buffers[1]`` is replaced when they move to a new buffer."""
        self._buffers[device].append((buffers, len(self.groups[device][2]) - count, count))

    def forget_write_backs(self) -> None:
        """The optimizers' groups changed: the write-back lists are made again at their next use."""
        self._write_backs.clear()

    # ------------------------------------------------------------------ gradients
    def grads_to_masters(self) -> None:
        """Move the half gradients into the masters' fp32 ``.grad`` and free them: one ``_foreach_copy_`` per device
        when every gradient is new since the last step (the usual case), a ``_foreach_add_`` where masters hold
        gradients the model did not show during the backward (:meth:`hide_grads`: accumulation under DDP, in fp32);
        then the model shows the masters' gradients (the half gradient tensors become them). Where it showed them,
        the backward added into them already (autograd adds into an existing gradient in place, in fp32), and another
        tensor in ``p.grad`` now was put there after the backward (``on_after_backward``): it replaces the master's."""
        accumulate, self._hidden = self._hidden, False
        for device, (params, masters, grad_views, shown) in self.groups.items():
            if not self.show:
                self._move_and_free(params, masters, grad_views, accumulate)
                continue
            halves = list(map(_grad_of, params))
            in_place = list(map(operator.is_, halves, shown))
            none = _nones(halves)
            fresh = len(halves) - none - in_place.count(True)
            if fresh == 0 and none == 0:
                continue  # every gradient shown, the backward added into them: nothing to move
            current = list(map(_grad_of, masters))
            if _nones(current) == len(current):  # every master's gradient freed since the last move: made again
                shown[:] = [_NOT_SHOWN if half is None else half for half in halves] if none else halves
                self._own_buffers(device)
                if none == 0:
                    torch._foreach_copy_(grad_views, halves)  # fp32 copies of the half gradients, exact
                    _set_each(masters, "grad", grad_views)
                    _set_each(halves, "data", grad_views)  # the half gradients become the masters' (no op)
                    continue
            elif fresh == len(halves) and all(map(operator.is_, current, grad_views)):
                if accumulate:  # hidden during the backward (DDP): the new gradients add up, in fp32
                    torch._foreach_add_(grad_views, halves)
                else:  # put there after the backward while the masters' were shown: they replace them
                    torch._foreach_copy_(grad_views, halves)
                shown[:] = halves
                _set_each(halves, "data", grad_views)
                continue
            fresh_halves = [None if s else h for h, s in zip(halves, in_place)]
            _merge_grads(masters, grad_views, fresh_halves, current, accumulate)
            for index, half in enumerate(fresh_halves):
                if half is not None:
                    shown[index] = half
                    half.data = grad_views[index]
            _show_missing(params, masters, grad_views, shown)

    def _move_and_free(
        self, params: list[nn.Parameter], masters: list[nn.Parameter], grad_views: list[Tensor], accumulate: bool
    ) -> None:
        """The move without showing (``show=False``): the half gradients into the masters' (copied where a master
        has none, added where it has one), then freed."""
        halves = list(map(_grad_of, params))
        if _nones(halves) == len(halves):
            return
        current = list(map(_grad_of, masters))
        if _nones(halves) == 0 and _nones(current) == len(current):
            torch._foreach_copy_(grad_views, halves)  # fp32 copies of the half gradients, exact
            _set_each(masters, "grad", grad_views)
        else:
            _merge_grads(masters, grad_views, halves, current, True)
        _set_each(params, "grad", repeat(None))

    def _own_buffers(self, device: torch.device) -> None:
        """Before the masters' gradients are made again on ``device``: a gradient buffer that something besides its
        own views still holds (a tensor kept from the gradients before ``zero_grad()``) is left to it, and the views
        move to a new buffer (one op per view, only then); otherwise the buffer is reused."""
        grad_views = self.groups[device][2]
        for buffers, start, count in self._buffers.get(device, ()):
            if _storage_uses(buffers[1]) <= count + 1:
                continue  # the buffer and its views only
            new = torch.empty_like(buffers[1])
            views = grad_views[start : start + count]
            pieces = new.split([view.numel() for view in views])  # in the order the views were cut at setup
            _set_each(views, "data", map(Tensor.view_as, pieces, views))
            buffers[1] = new

    def show_grads(self) -> None:
        """Every half parameter whose master has a gradient shows it (the parameters that show it already, and those
        without a master gradient, are left as they are)."""
        for params, masters, grad_views, shown in self.groups.values():
            if self.show:
                _show_missing(params, masters, grad_views, shown)

    def hide_grads(self) -> None:
        """The model's parameters show no gradient (the masters keep theirs) until the next move, which adds the new
        half gradients to the masters': before a backward whose half gradients must be new tensors of the parameters'
        dtype (DDP's buckets take those only)."""
        self._hidden = True
        for params, _, _, _ in self.groups.values():
            _set_each(params, "grad", repeat(None))

    def follow_shown_grads(self) -> None:
        """Make the masters' gradients and the model's agree again: a shown gradient set to ``None`` (``model.
        zero_grad()``, Lightning's before validation) frees the master's; another tensor in ``p.grad`` (assigned,
        or made by a backward while nothing was shown) becomes the master's gradient; masters' gradients freed
        (``optimizer.zero_grad()``) are shown no more. Two identity checks per device when nothing changed."""
        if not self.show:
            return
        for params, masters, grad_views, shown in self.groups.values():
            grads = list(map(_grad_of, params))
            current = list(map(_grad_of, masters))
            is_shown = list(map(operator.is_, grads, shown))
            has_view = list(map(operator.is_, current, grad_views))
            if (
                is_shown == has_view
                and _nones(grads) == is_shown.count(False)
                and _nones(current) == has_view.count(False)
                and _same_memory(compress(shown, is_shown), compress(grad_views, is_shown))
            ):
                continue  # each parameter shows its master's gradient, or neither has one
            if _nones(current) == len(current) and _nones(grads) + is_shown.count(True) == len(grads):
                _set_each(params, "grad", repeat(None))  # optimizer.zero_grad(): the model's are freed too
                continue
            _follow_each(params, masters, grad_views, shown, grads, current)

    # ------------------------------------------------------------------ weights
    def masters_to_model(self, optimizer: Optimizer, param_of_master: dict[int, nn.Parameter], key: Any) -> None:
        """Copy the masters ``optimizer`` holds into their half parameters (``param_of_master``: ``id(master) ->
        half parameter``), one ``_foreach_copy_`` per device. ``key``: equal to the last call's while no parameter's
        storage changed; the lists are made again when it differs."""
        made = self._write_backs.get(id(optimizer))
        if made is None or made[0] != key:
            made = self._write_backs[id(optimizer)] = (key, _write_back_lists(optimizer, param_of_master))
        for model_values, masters in made[1]:
            torch._foreach_copy_(model_values, masters)


def _write_back_lists(
    optimizer: Optimizer, param_of_master: dict[int, nn.Parameter]
) -> list[tuple[list[Tensor], list[Tensor]]]:
    by_device: dict[torch.device, tuple[list[Tensor], list[Tensor]]] = defaultdict(lambda: ([], []))
    for group in optimizer.param_groups:
        for master in group["params"]:
            param = param_of_master.get(id(master))
            if param is not None:
                model_values, masters = by_device[param.device]
                model_values.append(param.data)  # an alias with its own version counter, on the same storage
                masters.append(master.detach())
    return list(by_device.values())


def _nones(values: list[Any]) -> int:
    """How many of ``values`` are ``None``, by identity (``list.count(None)`` would compare each tensor with ``None``
    through ``Tensor.__eq__``: microseconds a tensor)."""
    return sum(map(operator.is_, values, repeat(None)))


def _same_memory(tensors: Iterable[Tensor], others: Iterable[Tensor]) -> bool:
    """Whether each of ``tensors`` starts where the matching one of ``others`` does, in the same dtype (looped in C):
    a shown gradient still is its master's (``p.grad.data = t`` gave it other memory)."""
    tensors, others = list(tensors), list(others)
    return list(map(Tensor.data_ptr, tensors)) == list(map(Tensor.data_ptr, others)) and list(
        map(_dtype_of, tensors)
    ) == list(map(_dtype_of, others))


def _set_each(tensors: Iterable[Tensor], name: str, values: Iterable[Any]) -> None:
    """``setattr(tensor, name, value)`` pairwise, looped in C (no Python frame per tensor)."""
    deque(map(setattr, tensors, repeat(name), values), maxlen=0)


def _storage_uses(tensor: Tensor) -> int:
    """How many tensors hold ``tensor``'s storage (``tensor`` included); without torch's count (older torch), a large
    number: the buffer is taken as held, and a new one made."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return sys.maxsize
    return use_count(tensor.untyped_storage()._cdata) - 1  # the storage object asked for here holds it too


def _show(params: list[nn.Parameter], shown: list[Tensor], values: list[Tensor]) -> None:
    """Each parameter's ``p.grad`` becomes its ``shown`` tensor, whose data is then ``values`` (the masters' fp32
    gradient views): torch checks a gradient's dtype when it is assigned, so the tensor holds the parameter's own
    data while it is. Three loops in C, no op."""
    _set_each(shown, "data", params)
    _set_each(params, "grad", shown)
    _set_each(shown, "data", values)


def _show_missing(
    params: list[nn.Parameter], masters: list[nn.Parameter], grad_views: list[Tensor], shown: list[Any]
) -> None:
    """:func:`_show` for the parameters whose master has its gradient view and whose ``p.grad`` is not shown yet
    (looped in C), with the tensor shown before where there is one, a new one otherwise."""
    has_view = map(operator.is_, map(_grad_of, masters), grad_views)
    not_shown = map(operator.is_not, map(_grad_of, params), shown)
    wanted = list(map(operator.and_, has_view, not_shown))
    if not any(wanted):
        return
    for index in compress(range(len(wanted)), wanted):
        if shown[index] is _NOT_SHOWN:
            shown[index] = grad_views[index].detach()
    _show(list(compress(params, wanted)), list(compress(shown, wanted)), list(compress(grad_views, wanted)))


def _follow_each(
    params: list[nn.Parameter],
    masters: list[nn.Parameter],
    grad_views: list[Tensor],
    shown: list[Any],
    grads: list[Optional[Tensor]],
    current: list[Optional[Tensor]],
) -> None:
    """:meth:`FlatMoves.follow_shown_grads` parameter by parameter (something changed on one side)."""
    copy_to, copy_from, show, repoint = [], [], [], []
    for index, (param, master, view, grad, value) in enumerate(zip(params, masters, grad_views, grads, current)):
        if grad is shown[index]:
            if value is None:  # the optimizer freed the master's gradient
                param.grad = None
            elif value is not view:  # a gradient assigned to the master: the view holds it, shown
                copy_to.append(view)
                copy_from.append(value)
                master.grad = view
            elif not _same_memory([grad], [view]):  # `p.grad.data = t`: the master's gradient becomes t
                copy_to.append(view)
                copy_from.append(grad)
                repoint.append((grad, view))
        elif grad is None:
            if value is view:  # the model's gradient was set to None: so is the master's
                master.grad = None
            elif value is not None:  # a gradient assigned to the master: the view holds it, shown
                copy_to.append(view)
                copy_from.append(value)
                master.grad = view
                show.append(index)
        else:  # another tensor in p.grad: it is the gradient now
            copy_to.append(view)
            copy_from.append(grad)
            master.grad = view
            show.append(index)
    if copy_to:
        torch._foreach_copy_(copy_to, copy_from)
    for grad, view in repoint:  # shown again: the master's gradient, now holding what was written
        grad.data = view
    for index in show:  # a tensor of its own, not one that code may hold from before
        shown[index] = grad_views[index].detach()
    if show:
        _show([params[i] for i in show], [shown[i] for i in show], [grad_views[i] for i in show])


def _merge_grads(
    masters: list[nn.Parameter], views: list[Tensor], halves: list[Any], current: list[Any], accumulate: bool
) -> None:
    """The half gradients ``halves`` (``None``: none) into the masters whose gradients are ``current``: copied into
    the flat views where a master has none (or, unless ``accumulate``, in place of the one it has), added where it has
    one and ``accumulate`` (in fp32)."""
    copy_to, copy_from, fresh, add_to, add_from = [], [], [], [], []
    for master, view, half, grad in zip(masters, views, halves, current):
        if half is None:
            continue
        if grad is None or not accumulate:
            copy_to.append(view)
            copy_from.append(half)
            fresh.append(master)
        else:
            add_to.append(grad)
            add_from.append(half)
    if copy_to:
        torch._foreach_copy_(copy_to, copy_from)
        _set_each(fresh, "grad", copy_to)
    if add_to:
        torch._foreach_add_(add_to, add_from)
