"""torchao's ``AdamW8bit`` and ``Adam8bit`` on lean master weights, in one pass per step.

torchao's 8-bit optimizers keep each moment blockwise-quantized (``OptimState8bit``: uint8 codes, one fp32 scale per
block of ``block_size`` elements, a 256-entry map), and their step dequantizes, applies Adam in fp32 and
requantizes. :class:`Adam8bitStep` runs that step on the exact fp32 masters that the bf16 weights and their int16
remainders join to, with the state *as torchao keeps it*: keyed by the model's parameters, made by torchao's own
``_new_buffer`` on an fp32 parameter of the same shape (quantized where the parameter has at least 4096 elements and
whole blocks, plain fp32 otherwise), so ``optimizer.state_dict()`` is the one torchao's optimizer of an fp32 model
saves, and loads into it and back.

The path is taken where the one pass runs (:func:`is_8bit`, :func:`kernel_for`: the C kernel built, and Triton for
CUDA parameters); elsewhere (no compiler, ``LIGHTNING_MP_NATIVE=0``) torchao's optimizers keep the generic path. Two
ways to run a step here, the same bits:

- one pass: :func:`lightning_mp.kernels.adam8bit.run_rows` on the CPU (on CUDA,
  :class:`lightning_mp.kernels.cuda_adam8bit.Adam8bitLaunch`, the same arithmetic), one call per param group over
  every parameter of it: each element's weight and remainder are joined, its moments dequantized, updated and
  requantized, and the weight split back, in one read and one write of each byte. Bitwise torchao's compiled step on
  the joined fp32 values (``tests/test_lean_adam8bit.py``, ``tests/test_eightbit_step.py``; the CUDA kernel bitwise
  the C kernel under Triton's interpreter: ``tests/test_cuda_adam8bit.py``).
- torchao's own step, for what the kernel does not take (clipping other than one clip-by-norm factor then one
  clip-by-value bound, gradients neither bf16 nor fp32, a parameter moved off the CPU): per parameter, its fp32
  value joined, torchao's compiled ``single_param_adam`` on it, split back; a ``found_inf`` flag is read on the host.

What a group's call reads is laid out once (:class:`_GroupLayout`: the addresses of the weights, remainders, codes,
scales, maps and step counts, and the tensors behind them, held) and replayed while the optimizer's generation
(:func:`lightning_mp.master.following.seen`) and the store's blocks are the ones it was laid out at; a step passes only
the gradients' addresses, the group's options, the clipping and the flag. The step inside backward lays out one
parameter at a time (:meth:`Adam8bitStep.run_params`). Under FSDP2 the same step runs on each rank's local shards
(:mod:`lightning_mp.distributed.fsdp2_eightbit`: ``sharded``, the state made on a ``DTensor`` stand-in).

``amsgrad`` is refused before any update: torchao 0.18 cannot run it on an 8-bit state either.
"""

from __future__ import annotations

import ctypes
from operator import attrgetter
from typing import Any, Optional, cast

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mp.grads import non_finite_check_and_unscale_
from lightning_mp.kernels import adam8bit, cuda, cuda_adam8bit, native
from lightning_mp.kernels.bits import join_fp32, split_fp32_into
from lightning_mp.master.following import group_index, seen
from lightning_mp.master.lean.chunked import apply_grad_ops, local_of
from lightning_mp.master.lean.interface import LeanStore

#: torchao's 8-bit Adam classes this path runs (``torchao.optim``), by name: ``is_adamw`` says which update.
CLASSES = ("AdamW8bit", "Adam8bit")
_GRAD = attrgetter("grad")
_DTYPE = attrgetter("dtype")
_FP32 = torch.float32
_GRAD_DTYPES = frozenset((torch.bfloat16, torch.float32))
_NO_CLIPPING: tuple[Optional[Tensor], Optional[float]] = (None, None)
_FIELDS = len(adam8bit.PIECE_FIELDS)
_GRAD_AT = adam8bit.PIECE_FIELDS.index("grad")
_FP32_AT = adam8bit.PIECE_FIELDS.index("grad_fp32")


def is_8bit(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` is exactly torchao's ``AdamW8bit`` or ``Adam8bit`` (a subclass may change the step) and
    this path runs it in one pass here (:func:`kernel_for` its parameters). Elsewhere (no C compiler; no Triton for
    CUDA parameters; ``LIGHTNING_MP_NATIVE=0``) the generic path keeps running it, with its chunks (bounded transient
    memory) and its skip on the device."""
    cls = type(optimizer)
    if cls.__name__ not in CLASSES or cls.__module__.split(".")[:2] != ["torchao", "optim"]:
        return False
    return kernel_for([p for group in optimizer.param_groups for p in group["params"]]) is not None


def kernel_for(params: list[Tensor]) -> Optional[str]:
    """Which one-pass kernel updates ``params``: ``"cpu"`` (all on the CPU: the C kernel), ``"cuda"`` (all on one
    CUDA device: the Triton kernel, :mod:`lightning_mp.kernels.cuda_adam8bit`, whose host part is the C library's),
    or ``None`` (torchao's own step): the C kernel must be built either way, and Triton installed for CUDA."""
    if not native.enabled() or adam8bit.cpu_kernel() is None:
        return None
    devices = {local_of(p).device for p in params}
    if all(device.type == "cpu" for device in devices):
        return "cpu"
    if len(devices) == 1 and next(iter(devices)).type == "cuda" and cuda.triton_available():
        return "cuda"
    return None


def _describe(optimizer: Optimizer, param: Tensor) -> str:
    index = group_index(optimizer, param)
    return (
        f"{type(optimizer).__name__}.state[param] of a parameter of shape {tuple(param.shape)} in "
        f"param_groups[{index if index is not None else '?'}]"
    )


def _check_group(optimizer: Optimizer, index: int, group: dict[str, Any]) -> None:
    name = type(optimizer).__name__
    if group.get("amsgrad"):
        raise NotImplementedError(
            f"master_weights='remainder' with {name}(amsgrad=True) (param_groups[{index}]): torchao 0.18 cannot run "
            "amsgrad on its 8-bit state either (torch.maximum is not implemented for OptimState8bit), so there is "
            "no result to equal. Nothing was updated. Use amsgrad=False, or torch.optim.AdamW(amsgrad=True)."
        )
    lr = group.get("lr")
    if not isinstance(lr, Tensor) or lr.numel() != 1:
        raise RuntimeError(
            f"{name}'s param_groups[{index}]['lr'] is {lr!r}, not the 1-element tensor torchao keeps (torchao "
            "raises here too). Nothing was updated. To change the lr, use "
            f"optimizer.param_groups[{index}]['lr'].fill_(new_lr) (LR schedulers do)."
        )


def _state_of(optimizer: Optimizer, param: Tensor, group: dict[str, Any]) -> dict[str, Any]:
    """``optimizer.state[param]``, made as torchao's step makes it where it is empty (on an fp32 parameter: the
    masters' precision), and checked: the keys torchao's step reads."""
    state = optimizer.state[param]
    if not state:
        like = _fp32_stand_in(param)
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = optimizer._new_buffer(like, True)  # type: ignore[attr-defined]
        state["exp_avg_sq"] = optimizer._new_buffer(like, False)  # type: ignore[attr-defined]
    _check_keys(optimizer, param, state)
    return state


def _check_keys(optimizer: Optimizer, param: Tensor, state: dict[str, Any]) -> None:
    for key in ("step", "exp_avg", "exp_avg_sq"):
        if key not in state:
            raise KeyError(
                f"{_describe(optimizer, param)} holds {sorted(state)} but not {key!r}: torchao makes a parameter's "
                "state only where it is empty, so a partly cleared state stops its step too. Nothing was updated. "
                "Clear the whole state (optimizer.state[param].clear()) or give it every key."
            )


def _piece_of(
    optimizer: Optimizer, param: Tensor, state: dict[str, Any], store: LeanStore
) -> Optional[tuple[list[int], list[Any]]]:
    """``param``'s row of the kernel's pieces (the gradient's fields left to each step) and the tensors behind its
    addresses (to hold), its state checked; ``None``: an fp32 parameter the kernel cannot update in place."""
    local = local_of(param)
    offset = store.offset_of(param)
    if offset is None:
        if local.dtype != _FP32 or not local.is_contiguous():
            return None
        high, low = local, None
        held: list[Any] = [local.untyped_storage()]
    else:
        high, low = store.flat_slices(local.device, offset, offset + local.numel())
        held = [high, low]
    piece = adam8bit.Adam8bitPiece(
        high, low, torch.empty(0, dtype=_FP32), local_of(state["exp_avg"]), local_of(state["exp_avg_sq"]), state["step"]
    )
    try:
        row = adam8bit.piece_row(piece, local.device.type)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"master_weights='remainder': {_describe(optimizer, param)} cannot be read as torchao's "
            f"{type(optimizer).__name__} state of an fp32 parameter ({error}). Nothing was updated. Clear it "
            "(optimizer.state[param].clear()) to start it again, or load torchao's own state."
        ) from None
    return row, held + adam8bit.tensors_of(piece)


def _fp32_stand_in(param: Tensor) -> Tensor:
    """What torchao's ``_new_buffer`` reads of ``param`` (shape, size, device, dtype; for a ``DTensor``, its local
    shard, mesh and placements) in fp32, the masters' precision, holding no memory. Under FSDP2 a ``DTensor`` like
    ``param`` around a stand-in of its local shard: torchao then quantises the local shard (from 4096 values, in
    blocks from the shard's start, as the kernel reads them) and wraps the state in a ``DTensor``, as it does for
    FSDP2's own fp32 shards."""
    local = local_of(param)
    like = torch.zeros((), dtype=_FP32, device=local.device).expand(local.shape)
    if local is param:
        return like
    from torch.distributed.tensor import DTensor

    sharded = cast(DTensor, param)
    return DTensor.from_local(
        like, sharded.device_mesh, sharded.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


class _GroupLayout:
    """What one call of the one-pass kernel reads for ``params`` (a group's, or one parameter's): the rows of
    :data:`~lightning_mp.kernels.adam8bit.PIECE_FIELDS` with every address but the gradients', and the tensors
    behind those addresses (held). ``None`` rows: the kernel cannot take these parameters (torchao's own step does)."""

    def __init__(self, optimizer: Optimizer, group: dict[str, Any], params: list[Tensor], store: LeanStore) -> None:
        self.stepped = [p for p in params if p.grad is not None]
        self.idle = [p for p in params if p.grad is None]  # a gradient appearing here lays the group out again
        store.check_trained(self.stepped)
        self.states = [_state_of(optimizer, p, group) for p in self.stepped]
        self.steps = [s["step"] for s in self.states]
        self.held: list[Any] = []
        self.rows: Any = None  # the C kernel's rows (a ctypes array, adam8bit.row_array), or None
        self.launch: Optional[cuda_adam8bit.Adam8bitLaunch] = None  # the CUDA kernel's (or None)
        self.dtypes: list[torch.dtype] = []
        kernel = kernel_for(self.stepped) if self.stepped else None
        if kernel is None:
            return  # torchao's step
        rows: list[int] = []
        for param, state in zip(self.stepped, self.states):
            piece = _piece_of(optimizer, param, state, store)
            if piece is None:
                return  # an fp32 parameter the kernel cannot update in place: torchao's step takes the group
            rows += piece[0]
            self.held += piece[1]
        if kernel == "cuda":
            self.launch = cuda_adam8bit.Adam8bitLaunch(rows, self.steps, local_of(self.stepped[0]).device)
            return
        self.rows = adam8bit.row_array(rows)
        self.first_unit = (ctypes.c_int64 * (len(self.stepped) + 1))()  # the kernel's work table, filled by it
        self.counts = adam8bit.counts_of(self.steps)


class _Stale(Exception):
    """A parameter of the layout has no gradient this step: lay the group out again."""


class Adam8bitStep:
    """The step of torchao's ``AdamW8bit`` / ``Adam8bit`` (``optimizer``) on ``store``'s lean state (module doc). It
    has the generic path's interface (:class:`~lightning_mp.master.lean.generic.GenericChunkedStep`), which
    :mod:`~lightning_mp.master.lean.update` calls; ``chunk_size`` is not used (each parameter is one piece)."""

    #: the state is keyed by the model's parameters (as torchao's): the store keeps it fp32 across loads
    whole_param_state = True
    #: inside backward, each parameter's gradient check is part of its step (``run_params(..., check=True)``)
    checks_gradients = True
    #: the parameters and gradients are ``DTensor`` s whose local shards the step reads (FSDP2's subclass)
    sharded = False

    def __init__(self, optimizer: Optimizer, store: LeanStore, chunk_size: int = 0) -> None:
        self.optimizer = optimizer
        self.store = store
        self.adamw = bool(getattr(optimizer, "is_adamw", type(optimizer).__name__ == "AdamW8bit"))
        self.layouts: dict[Any, _GroupLayout] = {}  # group index (or ("param", id)) -> its layout
        self.laid_out_at: tuple[int, int] = (-1, -1)  # (the optimizer's state generation, the store's blocks)
        self._group_of: dict[int, int] = {}  # id(param) -> its group's index (inside backward)
        self._compiled: Any = None
        #: inside backward on CUDA: (a launch's device skip flag, its parameters' step counts), advanced at end_params
        self._pending: list[tuple[Tensor, list[Tensor]]] = []
        #: a state_dict read between backward and the step sees the counts of that backward's updates
        self._settle = optimizer.register_state_dict_pre_hook(lambda _: self.end_params())

    # ------------------------------------------------------------------ the generic path's interface
    def initial_state(self) -> None:
        """Make the state of every trainable parameter that has none, as torchao's first step would (FSDP2: a
        distributed-checkpoint load must find the optimizer initialised, as
        :func:`~lightning_mp.master.lean.optimizers.initial_state` does for the table's optimizers)."""
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if param.requires_grad and not self.optimizer.state.get(param):
                    _state_of(self.optimizer, param, group)

    def follow_groups(self) -> None:
        """The groups changed: every layout is made again."""
        self.layouts.clear()
        self._group_of.clear()

    def restore(self) -> None:
        """At teardown: nothing to move, the state is already keyed by the parameters (the counts settled)."""
        self.end_params()
        self._settle.remove()
        self.layouts.clear()

    def begin_params(self) -> None:
        """Before the updates of one backward (the step inside backward): every group's options checked (a refusal
        before any parameter is updated); the layouts kept while the optimizer's state and groups are what they were
        laid out at."""
        self.end_params()  # a backward that did not finish: its counts settled first
        for index, group in enumerate(self.optimizer.param_groups):
            _check_group(self.optimizer, index, group)
        self._follow()
        if not self.layouts:  # the first backward, or the state or groups changed since the last layout
            self._check_states()
        if not self._group_of:
            for index, group in enumerate(self.optimizer.param_groups):
                for param in group["params"]:
                    self._group_of.setdefault(id(param), index)

    def run(self, found_inf: Optional[Tensor], grad_ops: list[tuple[str, Any]]) -> None:
        """One step of every group; where ``found_inf`` is nonzero nothing changes (weights, remainders, moments,
        step counts)."""
        self.end_params()
        self._follow()
        groups = self.optimizer.param_groups
        for index, group in enumerate(groups):
            _check_group(self.optimizer, index, group)
        made = False
        layouts = []
        for index, group in enumerate(groups):  # every layout first: a refusal comes before any update
            layout = self.layouts.get(index)
            if layout is None or any(p.grad is not None for p in layout.idle):
                layout = self.layouts[index] = _GroupLayout(self.optimizer, group, group["params"], self.store)
                made = True
            layouts.append(layout)
        for index, (group, layout) in enumerate(zip(groups, layouts)):
            try:
                self._step(group, layout, found_inf, grad_ops)
            except _Stale:  # a gradient set to None since (a parameter frozen): the parameters with one
                layout = self.layouts[index] = _GroupLayout(self.optimizer, group, group["params"], self.store)
                made = True
                self._step(group, layout, found_inf, grad_ops)
        if made:  # the state the layouts made is the step's own: they hold at the new generation
            self.laid_out_at = (seen(self.optimizer, state=True).state, self.store.layout_version)

    def run_params(
        self,
        params: list[Tensor],
        found_inf: Optional[Tensor],
        grad_ops: list[Any],
        on_host: Any = None,
        check: bool = False,
    ) -> None:
        """The step of ``params`` alone (inside backward: one parameter per call, from its hook). With ``check``,
        ``found_inf`` is the parameter's flag slot: set to 1 where its gradient holds an inf or a NaN, read first, as
        the in-backward flags' ``check`` would (in the same kernel call where the kernel runs)."""
        groups = self.optimizer.param_groups
        for param in params:
            index = self._group_of.get(id(param))
            if index is None:
                index = group_index(self.optimizer, param)
                if index is None:
                    continue
                self._group_of[id(param)] = index
            group = groups[index]  # (its options checked at begin_params)
            key = ("param", id(param))
            layout = self.layouts.get(key)
            if layout is None or (layout.idle and param.grad is not None):
                layout = self.layouts[key] = _GroupLayout(self.optimizer, group, [param], self.store)
            self._step(group, layout, found_inf, grad_ops, check, inside=True)

    def end_params(self) -> None:
        """After the updates of one backward: the step counts of the parameters whose CUDA launch was skipped or not
        by a flag on the device advance where the flag was 0 (one host read of the flags for the whole backward, not
        one per parameter)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        flags = torch.stack([flag.reshape(()) for flag, _ in pending]).tolist()  # the one read
        ran = {id(step): step for (_, steps), flag in zip(pending, flags) if flag == 0 for step in steps}
        if ran:
            torch._foreach_add_(list(ran.values()), 1.0)

    # ------------------------------------------------------------------ the step of one layout
    def _check_states(self) -> None:
        """Inside backward, where the layouts were dropped (the state or the groups changed, or the first backward):
        every state the hooks will read is checked before any parameter is updated (its keys, and what the kernel
        reads of it), as the normal step lays out every group before its first update. A parameter with no state
        yet is left alone (torchao makes its state at its first step, if it has a gradient)."""
        optimizer = self.optimizer
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state.get(param)
                if state:
                    _check_keys(optimizer, param, state)
                    if kernel_for([param]) is not None:
                        _piece_of(optimizer, param, state, self.store)

    def _follow(self) -> None:
        now = (seen(self.optimizer, state=True).state, self.store.layout_version)
        if now != self.laid_out_at:
            self.layouts.clear()
            self._group_of.clear()
            self.laid_out_at = now

    def _step(
        self,
        group: dict[str, Any],
        layout: _GroupLayout,
        found: Optional[Tensor],
        grad_ops: list[tuple[str, Any]],
        check: bool = False,
        inside: bool = False,
    ) -> None:
        if not layout.stepped:
            return
        grads = list(map(_GRAD, layout.stepped))
        if None in grads:
            raise _Stale
        if self.sharded:  # FSDP2: this rank's gradient shards (a DTensor op would be a collective)
            grads = list(map(local_of, grads))
        if layout.launch is not None:
            self._cuda_step(group, layout, grads, found, grad_ops, check, inside)
            return
        clipping = _clipping(grad_ops, layout.rows is not None) if grad_ops else _NO_CLIPPING
        dtypes = list(map(_DTYPE, grads))
        on_cpu = found is None or (found.device.type == "cpu" and found.dtype == _FP32)
        odd = dtypes != layout.dtypes and not _GRAD_DTYPES.issuperset(dtypes)  # neither bf16 nor fp32
        if layout.rows is None or clipping is None or not on_cpu or odd:
            if check and found is not None:  # the check-only non-finite check, as the in-backward flags run it
                non_finite_check_and_unscale_(grads, found, found.new_ones(1), check_only=True)
            self._torchao_step(group, layout, grads, found, grad_ops)
            return
        if not all(map(Tensor.is_contiguous, grads)):  # read by address: a contiguous copy for this step
            grads = [g.contiguous() for g in grads]
        rows = layout.rows  # written in place: the gradients' addresses (and dtypes where they changed)
        rows[_GRAD_AT::_FIELDS] = list(map(Tensor.data_ptr, grads))
        if dtypes != layout.dtypes:
            rows[_FP32_AT::_FIELDS] = [int(d == _FP32) for d in dtypes]
            layout.dtypes = dtypes
        options = self._options(group, clipping)
        if options["lr"].dtype != _FP32 or options["lr"].device.type != "cpu":
            options["lr"] = options["lr"].to("cpu", _FP32)
        adam8bit.run_rows(
            rows, len(layout.stepped), layout.counts, **options, found_inf=None if check else found,
            check=found if check else None, first_unit=layout.first_unit, held=layout.held,
        )  # fmt: skip

    def _options(self, group: dict[str, Any], clipping: tuple[Optional[Tensor], Optional[float]]) -> dict[str, Any]:
        """The kernels' options of a step of ``group`` (torchao's ``lr`` tensor as it is), with the clipping."""
        betas = group["betas"]
        return dict(
            lr=group["lr"], beta1=betas[0], beta2=betas[1], eps=group["eps"], weight_decay=group["weight_decay"],
            adamw=self.adamw, grad_mul=clipping[0], clamp=clipping[1],
        )  # fmt: skip

    def _cuda_step(
        self,
        group: dict[str, Any],
        layout: _GroupLayout,
        grads: list[Tensor],
        found: Optional[Tensor],
        grad_ops: list[tuple[str, Any]],
        check: bool,
        inside: bool,
    ) -> None:
        """The step of a layout on CUDA (:mod:`~lightning_mp.kernels.cuda_adam8bit`). torchao's step counts are on the
        host: the normal step reads a found flag there first (one synchronisation per step, as ``GradScaler.step``);
        inside backward (``inside``) the launch takes the parameter's flag on the device (with ``check``, its gradient
        checked into it first) and its counts advance at :meth:`end_params`."""
        assert layout.launch is not None
        launch = layout.launch
        clipping = _clipping(grad_ops, True, launch.device) if grad_ops else _NO_CLIPPING
        dtypes = list(map(_DTYPE, grads))
        if check and found is not None:  # the check-only non-finite check, as the in-backward flags run it
            non_finite_check_and_unscale_(grads, found, found.new_ones(1), check_only=True)
        if clipping is None or not _GRAD_DTYPES.issuperset(dtypes):
            self._torchao_step(group, layout, grads, found, grad_ops)
            return
        deferred = inside and found is not None
        if found is not None and not deferred and bool(found.item()):  # the whole step skipped
            return
        if not all(map(Tensor.is_contiguous, grads)):
            grads = [g.contiguous() for g in grads]
        if dtypes != layout.dtypes:  # the rows say which gradients are fp32: sent again for a new mix
            layout.dtypes = dtypes
            launch.set_grad_dtypes([d == _FP32 for d in dtypes])
        launch.run(grads, **self._options(group, clipping), found=found if deferred else None)
        if deferred:
            assert found is not None
            self._pending.append((found, layout.steps))

    def _torchao_step(
        self,
        group: dict[str, Any],
        layout: _GroupLayout,
        grads: list[Tensor],
        found: Optional[Tensor],
        grad_ops: list[tuple[str, Any]],
    ) -> None:
        """torchao's own compiled step on each parameter's joined fp32 value (module doc)."""
        if found is not None and bool(found.item()):  # read on the host: the whole step skipped
            return
        if self._compiled is None:
            from torchao.optim.adam import single_param_adam

            self._compiled = torch.compile(single_param_adam, fullgraph=True, dynamic=False)
        betas = group["betas"]
        store = self.store
        with torch.no_grad():
            for param, grad, state in zip(layout.stepped, grads, layout.states):
                local = local_of(param)
                offset = store.offset_of(param)
                if offset is None:
                    value = local
                else:
                    high, low = store.flat_slices(local.device, offset, offset + local.numel())
                    value = join_fp32(high, low).view(local.shape)
                grad32 = grad.to(_FP32, copy=True).view(local.shape)
                apply_grad_ops(grad32, grad_ops)
                state["step"] += 1
                with torch._dynamo.utils.disable_cache_limit():
                    self._compiled(
                        value, grad32, state["step"], local_of(state["exp_avg"]), local_of(state["exp_avg_sq"]),
                        None, group["lr"], betas[0], betas[1], group["weight_decay"], group["eps"], self.adamw, False,
                    )  # fmt: skip
                if offset is not None:
                    split_fp32_into(value.view(-1), high, low)


def _clipping(
    grad_ops: list[tuple[str, Any]], kernel: bool, device: Any = "cpu"
) -> Optional[tuple[Optional[Tensor], Optional[float]]]:
    """``(factor, clamp)`` the kernel applies: at most one clip-by-norm factor (on ``device``, the kernel's), then at
    most one clip-by-value bound (the order Lightning applies them); ``None``: torchao's step applies ``grad_ops``."""
    if not kernel:
        return None
    factor: Optional[Tensor] = None
    clamp: Optional[float] = None
    for kind, value in grad_ops:
        if kind == "mul" and factor is None and clamp is None:
            factor = value.detach().to(device, _FP32).reshape(1).contiguous()
        elif kind == "clamp" and clamp is None:
            clamp = float(value)
        else:
            return None
    return factor, clamp


__all__ = ["Adam8bitStep", "CLASSES", "is_8bit"]
