"""The gradients a step checks: parameters grouped once by device and dtype, the inf/NaN check that unscales them
in place (every dtype on every device), and the names of the non-finite ones.

Below both the loss scaler (:mod:`lightning_mp.scaler`, which unscales and checks through it) and the weights
(:mod:`lightning_mp.master`: the step inside backward checks each gradient in its hook with the same check): it
imports nothing of the library but the kernels (:mod:`lightning_mp.kernels`, the compiled read-only check).

- :class:`GradientGroups`: parameters grouped once by device and dtype (the check kernel takes one device per call and
  runs fastest on one dtype); each step then only reads their ``.grad`` (sparse values, ``DTensor`` local shards).
- :func:`non_finite_check_and_unscale_`: torch's ``_amp_foreach_non_finite_check_and_unscale_`` for every dtype on
  every device (bf16 on CUDA through a max-abs norm), and a read-only check on the CPU for a step without a scale.
- :func:`nonfinite_names`: which of the checked gradients hold inf or NaN, for the errors that name them.
"""

from __future__ import annotations

import functools
import operator
from typing import Iterable, Iterator, Optional, Union

import torch
from torch import Tensor

_GRAD = operator.attrgetter("grad")
_IS_TENSOR = functools.partial(operator.is_not, None)  # a gradient, not None

# What `DynamicLossScaler.unscale_` accepts: tensors whose ``.grad`` is unscaled, or ``(name, tensor)`` pairs.
NamedOrPlainParams = Iterable[Union[Tensor, tuple[str, Tensor]]]
# What one check saw (`GradientGroups.gradients`): per device, per dtype, the names and the gradients checked.
Checked = list[tuple[torch.device, list[tuple[list[str], list[Tensor]]]]]


# ------------------------------------------------------------------------------------------ the gradients it checks
class GradientGroups:
    """``params`` (tensors, or ``(name, tensor)`` pairs: names for the errors) grouped once by device and dtype.

    The grouping is by the parameters' device and dtype, which are their gradients' (torch refuses a ``.grad`` of
    another device or dtype); a caller that checks the same parameters every step builds it once
    (``lightning_mp.stepping`` does, per optimizer) and :meth:`gradients` then only reads each ``.grad``. Sparse
    gradients are coalesced (duplicate indices are summed: the sums are what may overflow) and their values checked;
    ``DTensor`` gradients through their local shards (same storage: unscaling them unscales the ``DTensor``).
    """

    def __init__(self, params: NamedOrPlainParams) -> None:
        named = [item if isinstance(item, tuple) else (f"<unnamed #{i}>", item) for i, item in enumerate(params)]
        by_device: dict[torch.device, dict[torch.dtype, tuple[list[str], list[Tensor]]]] = {}
        for name, param in named:
            names, group = by_device.setdefault(param.device, {}).setdefault(param.dtype, ([], []))
            names.append(name)
            group.append(param)
        self.groups = [list(per_dtype.values()) for per_dtype in by_device.values()]
        self.named = named
        # subclasses (DTensor) have local shards to take; plain tensors and parameters do not
        self.plain = all(type(param) in (Tensor, torch.nn.Parameter) for _, param in named)

    def first_gradient_device(self) -> Optional[torch.device]:
        """The device of the first parameter (in the order given) that has a gradient; ``None`` if none has."""
        return next((grad.device for _, param in self.named if (grad := param.grad) is not None), None)

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        """The ``(name, parameter)`` pairs, in the order given: a ``GradientGroups`` is what it was built from."""
        return iter(self.named)

    def gradients(self) -> Checked:
        """This step's gradients to check: per device (in order of first appearance), per dtype, their names and the
        gradients; parameters without a gradient are left out, and so are devices and dtypes without any."""
        found = []
        for per_dtype in self.groups:
            lists = []
            for names, params in per_dtype:
                grads = list(filter(_IS_TENSOR, map(_GRAD, params)))  # C-level passes: no frame per step
                if len(grads) != len(params):  # some have no gradient (yet): name the others only
                    names = [name for name, param in zip(names, params) if param.grad is not None]
                if not self.plain or True in [grad.is_sparse for grad in grads]:  # (no generator frame per step)
                    grads = [_checked_form(param) for param in params if param.grad is not None]
                if grads:
                    lists.append((names, grads))
            if lists:
                found.append((lists[0][1][0].device, lists))
        return found


def nonfinite_names(checked: Checked) -> list[str]:
    """Names of the gradients in ``checked`` that hold inf or NaN (one host synchronisation each: for errors)."""
    return [
        name
        for _, lists in checked
        for names, grads in lists
        for name, grad in zip(names, grads)
        if not torch.isfinite(grad).all()
    ]


def _checked_form(param: Tensor) -> Tensor:
    """What of ``param.grad`` the kernel checks: a sparse gradient's values, once coalesced; a DTensor's local shard."""
    grad = param.grad
    assert grad is not None
    if grad.is_sparse:
        if not grad.is_coalesced():
            param.grad = grad = grad.coalesce()
        grad = grad._values()
    to_local = getattr(grad, "to_local", None)
    return to_local() if to_local is not None else grad


# ------------------------------------------------------------------ the check, for every dtype on every device
# torch's CUDA kernel (_amp_foreach_non_finite_check_and_unscale_) takes fp32 and fp16 gradients but not bf16 ("not
# implemented for 'BFloat16'"), which lean masters (bf16 parameters, bf16 gradients) meet on a GPU. There the check
# is the max-abs norm of each gradient (torch._foreach_norm with ord=inf: one multi-tensor kernel; an inf or NaN
# element makes the norm inf or NaN, and a max cannot overflow), and the unscale one torch._foreach_mul_. A
# check-only step on the CPU reads the gradients without writing them back (torch's kernel multiplies them by one).


#: gradient elements from which a check-only step reads them through the compiled check (below: torch's kernel,
#: whose call costs less than the ctypes call for small models; measured with benchmarks/framework_overhead.py)
_READ_ONLY_FROM = 1 << 20


def non_finite_check_and_unscale_(
    grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor, check_only: bool = False
) -> None:
    """Multiply ``grads`` (one device, one dtype) by ``inv_scale`` in place and set ``found_inf`` (a 1-element fp32
    tensor) to 1 if any element is inf or NaN, as ``torch._amp_foreach_non_finite_check_and_unscale_`` does.
    ``check_only`` (``inv_scale`` is one): read the gradients without writing them back, on the CPU through the
    compiled check of :mod:`lightning_mp.kernels.native` where it is built, for a few bf16 gradients on CUDA through
    :func:`lightning_mp.kernels.cuda.check_nonfinite` (one Triton launch each) where Triton is there."""
    if check_only and grads and grads[0].device.type == "cpu" and sum(map(Tensor.numel, grads)) >= _READ_ONLY_FROM:
        from lightning_mp.kernels import native  # the kernel's module, loaded on first use

        if native.check_nonfinite(grads, found_inf):
            return
    if grads and grads[0].dtype == torch.bfloat16 and grads[0].device.type != "cpu":
        if check_only and grads[0].device.type == "cuda":  # one launch per gradient where Triton is there
            from lightning_mp.kernels import cuda  # the kernel's module, loaded on first use

            if cuda.check_nonfinite(grads, found_inf):
                return
        return check_and_unscale_by_norm_(grads, found_inf, None if check_only else inv_scale)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def check_and_unscale_by_norm_(grads: list[Tensor], found_inf: Tensor, inv_scale: Optional[Tensor]) -> None:
    """The same through ``torch._foreach_norm(ord=inf)`` and ``torch._foreach_mul_`` (any dtype, any device);
    ``inv_scale=None``: check only (a bf16 step has no scale; multiplying each gradient by one was a kernel launch
    per gradient for nothing, seen in an H100 profile: mixed dtypes take the per-tensor path)."""
    norms = torch._foreach_norm(grads, float("inf"))
    bad = torch.stack(norms).isfinite().logical_not().any()
    found_inf.copy_(torch.maximum(found_inf, bad.to(found_inf.dtype).reshape(found_inf.shape)))
    if inv_scale is not None:
        torch._foreach_mul_(grads, inv_scale.reshape(()))  # computed in fp32, as torch's kernel does
