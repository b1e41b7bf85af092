"""torchao's 8-bit Adam/AdamW step on lean master weights in one pass: ``lean_adam8bit.c``, built and loaded like
``lean_update.c`` (:mod:`.native`).

:func:`adam8bit_step` steps one parameter held as bf16 weights plus int16 remainders (or an fp32 parameter) with
torchao's ``AdamW8bit`` / ``Adam8bit`` state *as torchao keeps it*: the ``codes`` (uint8), ``scale`` (fp32, one per
block) and ``qmap`` (fp32, 256 entries) tensors of its ``OptimState8bit`` moments are read and written in place, and
a plain fp32 moment (torchao's state of a tensor under 4096 elements or not a multiple of its block) is updated as a
plain tensor. So the optimizer's ``state_dict`` stays torchao's and loads into torchao's optimizer and back.

The result is the same bits as torchao's own (``torch.compile``-d) step of the fp32 weights the bf16 weights and
remainders join to (``tests/test_lean_adam8bit.py`` compares weights, codes and scales): see the C file's header for
the arithmetic. ``amsgrad`` is refused: torchao 0.18's step cannot run it on a quantized state (``torch.maximum`` is
not implemented for ``OptimState8bit``), so there is no result to equal.

Building: the C compiler, flags and cache of :mod:`.native` (``$LIGHTNING_MP_CACHE``, ``LIGHTNING_MP_NATIVE=0``,
``LIGHTNING_MP_OPENMP=0``), and its choice between torch's OpenMP pool and threads of its own. :func:`cpu_kernel`
returns ``None`` after one warning where the kernel cannot be built.
"""

from __future__ import annotations

import ctypes
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
from torch import Tensor

from lightning_mp.kernels import native

SOURCE = Path(__file__).with_name("lean_adam8bit.c")
#: Elements per unit of work handed to a thread, rounded down to whole blocks (at least one).
GRAIN = 1 << 16
#: Entries of an 8-bit map (torchao's ``qmap``).
QMAP_SIZE = 256

_state: dict[str, Any] = {}


#: The fields of one piece as the kernel reads them (``a8_piece`` in ``lean_adam8bit.c``: 8 bytes each, in this
#: order): addresses (0 for none), then counts.
PIECE_FIELDS = (
    *("high", "low", "grad", "codes1", "scale1", "qmap1", "codes2", "scale2", "qmap2", "state1", "state2", "step"),
    *("n", "block", "grad_fp32"),
)


# ---------------------------------------------------------------------- building (native.py's way, another source)
def _build(compiler: str, flags: list[str]) -> Path:
    return native.build("lean_adam8bit", native.compose(SOURCE.read_text()).encode(), compiler, flags)


def cpu_kernel() -> Optional[ctypes.CDLL]:
    """The compiled kernel (built on first use), or ``None`` (one warning) where it cannot be built."""
    if "cpu" in _state:
        return _state["cpu"]
    library = None
    if native.enabled():
        compiler = native.find_compiler()
        try:
            if compiler is None:
                raise RuntimeError("no C compiler found (looked for $CC, cc, gcc, clang)")
            library = native.load_openmp(lambda flags: _build(compiler, flags))
            _state["threading"] = "openmp" if library is not None else "pthreads"
            if library is None:
                library = ctypes.CDLL(str(_build(compiler, native.CFLAGS)))
            library.lean_adam8bit.restype = None
            library.lean_adam8bit.argtypes = [
                ctypes.POINTER(ctypes.c_int64),  # the pieces (PIECE_FIELDS each)
                ctypes.c_int64,
                ctypes.c_int,  # adamw
                *[ctypes.c_double] * 4,  # beta1, beta2, weight_decay, eps
                *[ctypes.c_void_p] * 2,  # lr, grad_mul
                ctypes.c_double,  # clamp (negative: none)
                *[ctypes.c_void_p] * 3,  # found_inf, check, counts (an array of addresses)
                ctypes.c_int64,  # ncounts
                ctypes.c_int,  # threads
                ctypes.c_int64,  # grain
                ctypes.POINTER(ctypes.c_int64),  # first_unit (npieces + 1)
            ]
            library.lean_adam8bit_bias.restype = None  # (the CUDA kernel's host part: kernels/cuda_adam8bit.py)
            library.lean_adam8bit_bias.argtypes = [
                ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_double,
                ctypes.c_int, ctypes.c_void_p,
            ]  # fmt: skip
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            warnings.warn(
                f"lightning_mp: the one-pass 8-bit Adam update could not be built ({error}). Install a C compiler "
                "(gcc or clang) to get it, or set LIGHTNING_MP_NATIVE=0 to silence this.",
                RuntimeWarning,
                stacklevel=2,
            )
            library = None
    _state["cpu"] = library
    return library


def threading_model() -> Optional[str]:
    """``"openmp"`` (torch's OpenMP threads), ``"pthreads"`` (threads of its own) or ``None`` (no kernel)."""
    return None if cpu_kernel() is None else _state.get("threading")


# ---------------------------------------------------------------------- the step
Moment = Tensor  # torchao's OptimState8bit (``codes``, ``scale``, ``qmap``) or a plain fp32 tensor


@dataclass
class Adam8bitPiece:
    """One parameter of a step: its weights (``high`` bf16 with ``low`` int16 remainders, or ``high`` fp32 and
    ``low`` ``None``), gradient (bf16 or fp32), torchao's moments and step count (a 1-element fp32 CPU tensor)."""

    high: Tensor
    low: Optional[Tensor]
    grad: Tensor
    exp_avg: Moment
    exp_avg_sq: Moment
    step: Tensor


def _plain(
    t: Tensor, name: str, dtypes: tuple[torch.dtype, ...], numel: Optional[int] = None, device: str = "cpu"
) -> int:
    """``t``'s address once it is a contiguous tensor of one of ``dtypes`` (and ``numel`` elements) on a ``device``
    (a device type: ``"cpu"``, or ``"cuda"`` for the CUDA kernel's rows)."""
    if type(t) is not Tensor and not isinstance(t, torch.nn.Parameter):
        raise TypeError(f"{name}: a plain tensor is needed, got {type(t).__name__}")
    if t.device.type != device or not t.is_contiguous() or t.dtype not in dtypes:
        raise ValueError(
            f"{name}: a contiguous {device.upper()} tensor of {dtypes} is needed, got {t.dtype} on {t.device}"
        )
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name}: {numel} elements expected, got {t.numel()}")
    return t.data_ptr()


def _is_quantized(moment: Moment) -> bool:
    return all(hasattr(moment, name) for name in ("codes", "scale", "qmap"))


def _inner(moment: Any) -> tuple[Tensor, Tensor, Tensor]:
    """An 8-bit state's ``codes``, ``scale`` and ``qmap`` (torchao's ``OptimState8bit``, typed as a plain tensor)."""
    return moment.codes, moment.scale, moment.qmap


def _piece(p: Adam8bitPiece, index: int, device: str = "cpu") -> list[int]:
    """``p``'s row; ``device``: where its tensors are (the step count is on the CPU whatever it is: torchao's)."""
    n = p.high.numel()
    if p.low is None:
        high = _plain(p.high, f"pieces[{index}].high", (torch.float32,), device=device)
        low = None
    else:
        high = _plain(p.high, f"pieces[{index}].high", (torch.bfloat16,), device=device)
        low = _plain(p.low, f"pieces[{index}].low", (torch.int16,), n, device)
    grad = _plain(p.grad, f"pieces[{index}].grad", (torch.bfloat16, torch.float32), n, device)
    step = _plain(p.step, f"pieces[{index}].step", (torch.float32,), 1)
    fields: dict[str, Any] = dict(high=high, low=low, grad=grad, step=step, n=n)
    fields["grad_fp32"] = int(p.grad.dtype == torch.float32)
    quantized = [_is_quantized(m) for m in (p.exp_avg, p.exp_avg_sq)]
    if quantized == [True, True]:
        block = None
        for k, (moment, signed) in enumerate([(p.exp_avg, True), (p.exp_avg_sq, False)], start=1):
            name = f"pieces[{index}].{'exp_avg' if k == 1 else 'exp_avg_sq'}"
            if getattr(moment, "signed", signed) is not signed:
                raise ValueError(f"{name}: a {'signed' if signed else 'unsigned'} 8-bit state is expected")
            codes, scale, qmap = _inner(moment)
            scales = scale.numel()
            if scales == 0 or n % scales:
                raise ValueError(f"{name}: {n} elements do not make whole blocks of {scales} scales")
            if block is not None and block != n // scales:
                raise ValueError(f"pieces[{index}]: exp_avg and exp_avg_sq have different block sizes")
            block = n // scales
            fields[f"codes{k}"] = _plain(codes, f"{name}.codes", (torch.uint8,), n, device)
            fields[f"scale{k}"] = _plain(scale, f"{name}.scale", (torch.float32,), device=device)
            fields[f"qmap{k}"] = _plain(qmap, f"{name}.qmap", (torch.float32,), QMAP_SIZE, device)
        fields["block"] = block
    elif quantized == [False, False]:
        fields["state1"] = _plain(p.exp_avg, f"pieces[{index}].exp_avg", (torch.float32,), n, device)
        fields["state2"] = _plain(p.exp_avg_sq, f"pieces[{index}].exp_avg_sq", (torch.float32,), n, device)
    else:
        raise ValueError(f"pieces[{index}]: exp_avg and exp_avg_sq must both be 8-bit states or both fp32 tensors")
    return [int(fields.get(name) or 0) for name in PIECE_FIELDS]


def adam8bit_step_pieces(
    pieces: Sequence[Adam8bitPiece],
    *,
    lr: Union[float, Tensor],
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    adamw: bool = True,
    amsgrad: bool = False,
    grad_mul: Optional[Tensor] = None,
    clamp: Optional[float] = None,
    found_inf: Optional[Tensor] = None,
    increment_step: bool = True,
) -> None:
    """torchao's ``AdamW8bit`` (``adamw=True``) or ``Adam8bit`` step of every piece, in one pass on the CPU.

    ``lr``: a float or torchao's ``group["lr"]`` (a 1-element fp32 tensor); the other options as in torchao's param
    group (``betas``, ``eps``, ``weight_decay``). ``grad_mul``: a 1-element fp32 CPU tensor every gradient is
    multiplied by first (an unscale factor, a clipping coefficient), as ``grad.mul_(factor)`` in fp32; ``clamp``: then
    clipped to ``[-clamp, clamp]`` as ``clamp_min_(-clamp).clamp_max_(clamp)`` in fp32 (``clip_grad_value_``).
    ``found_inf``: a 1-element fp32 CPU tensor; when nonzero nothing is written (weights, remainders, moments, step
    counts). With ``increment_step`` each distinct step tensor advances by one first (torchao's
    ``state["step"] += 1``); without it the counts are read as they are.
    """
    if amsgrad:
        raise NotImplementedError(
            "amsgrad with torchao's 8-bit state: torchao 0.18's own step cannot run it (torch.maximum is not "
            "implemented for OptimState8bit), so there is no result to equal; use amsgrad=False"
        )
    library = cpu_kernel()
    if library is None:
        raise RuntimeError("the one-pass 8-bit Adam kernel is not built here (see the warning above)")
    if isinstance(lr, Tensor):
        lr_tensor = lr.detach()
        _plain(lr_tensor, "lr", (torch.float32,), 1)
    else:
        lr_tensor = torch.tensor(float(lr), dtype=torch.float32)  # torchao's group["lr"]
    table = [value for i, p in enumerate(pieces) for value in _piece(p, i)]
    array = (ctypes.c_int64 * max(1, len(table)))(*table)
    factor = _plain(grad_mul, "grad_mul", (torch.float32,), 1) if grad_mul is not None else None
    flag = _plain(found_inf, "found_inf", (torch.float32,), 1) if found_inf is not None else None
    counts: list[int] = []
    if increment_step:
        counts = list(dict.fromkeys(p.step.data_ptr() for p in pieces))  # a step shared by pieces advances once
    count_array = (ctypes.c_void_p * max(1, len(counts)))(*counts)
    first_unit = (ctypes.c_int64 * (len(pieces) + 1))()
    library.lean_adam8bit(
        array, len(pieces), int(adamw), float(beta1), float(beta2), float(weight_decay), float(eps),
        lr_tensor.data_ptr(), factor, float(clamp) if clamp is not None else -1.0, flag, None, count_array, len(counts),
        native.threads_for(_state.get("threading")), GRAIN, first_unit,
    )  # fmt: skip


def adam8bit_step(
    high: Tensor, low: Optional[Tensor], grad: Tensor, exp_avg: Moment, exp_avg_sq: Moment, step: Tensor, **options: Any
) -> None:
    """One parameter's step (:func:`adam8bit_step_pieces` with one piece): ``high`` bf16 and ``low`` int16 (or
    ``high`` fp32 and ``low`` ``None``), ``exp_avg`` / ``exp_avg_sq`` torchao's state tensors, ``step`` its count."""
    adam8bit_step_pieces([Adam8bitPiece(high, low, grad, exp_avg, exp_avg_sq, step)], **options)


# ---------------------------------------------------------------------- laid out once, replayed (the lean step's)
def piece_row(piece: Adam8bitPiece, device: str = "cpu") -> list[int]:
    """``piece``'s row of :data:`PIECE_FIELDS` for :func:`run_rows` (or, its tensors on ``device="cuda"``, for
    :class:`~lightning_mp.kernels.cuda_adam8bit.Adam8bitLaunch`), checked as :func:`adam8bit_step_pieces` checks
    it; its gradient's address and dtype are the caller's to fill in each step (``piece.grad`` is not read)."""
    like = Adam8bitPiece(piece.high, piece.low, piece.high, piece.exp_avg, piece.exp_avg_sq, piece.step)
    return _piece(like, 0, device)


def tensors_of(piece: Adam8bitPiece) -> list[Tensor]:
    """The tensors whose addresses :func:`piece_row` gives (but the gradient): whoever replays the row holds them."""
    moments = [
        t for m in (piece.exp_avg, piece.exp_avg_sq) for t in (_inner(m) if _is_quantized(m) else (m,))
    ]  # fmt: skip
    return [t for t in (piece.high, piece.low, *moments, piece.step) if t is not None]


def row_array(rows: list[int]) -> Any:
    """``rows`` (:func:`piece_row` after piece_row) as the ctypes array :func:`run_rows` takes: laid out once, its
    gradients' fields written in place each step (``array[field::len(PIECE_FIELDS)] = ...``)."""
    return (ctypes.c_int64 * max(1, len(rows)))(*rows)


def counts_of(steps: Sequence[Tensor]) -> Any:
    """The step counts the kernel advances (each distinct tensor once): a ctypes array of their addresses."""
    counts = list(dict.fromkeys(step.data_ptr() for step in steps))
    return (ctypes.c_void_p * len(counts))(*counts)


def run_rows(
    rows: Any,
    count: int,
    counts: Any,
    *,
    lr: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw: bool,
    grad_mul: Optional[Tensor] = None,
    clamp: Optional[float] = None,
    found_inf: Optional[Tensor] = None,
    check: Optional[Tensor] = None,
    first_unit: Any = None,
    held: Any = None,
) -> None:
    """One step of ``count`` pieces laid out as ``rows`` (:func:`row_array` of :func:`piece_row`'s rows, each with
    its gradient's address and dtype filled in), as :func:`adam8bit_step_pieces` steps them: ``lr`` a 1-element fp32 CPU tensor, ``grad_mul`` one
    too (or ``None``), ``clamp`` a clip-by-value bound applied after it (or ``None``), ``found_inf`` a 1-element fp32
    CPU tensor (nonzero: nothing is written), ``counts`` (:func:`counts_of`) advanced by one first. ``check``: a
    1-element fp32 CPU flag set to 1 where a gradient holds an inf or a NaN (read first), then taken as ``found_inf``
    (the step inside backward's check and update in one call). ``first_unit``: a ctypes array of ``count + 1`` int64
    the kernel fills (made here where ``None``). ``held``: the caller's tensors behind the addresses (kept alive
    across the call)."""
    library = cpu_kernel()
    if library is None:
        raise RuntimeError("the one-pass 8-bit Adam kernel is not built here (see the warning above)")
    if first_unit is None:
        first_unit = (ctypes.c_int64 * (count + 1))()
    library.lean_adam8bit(
        rows, count, int(adamw), float(beta1), float(beta2), float(weight_decay), float(eps), lr.data_ptr(),
        grad_mul.data_ptr() if grad_mul is not None else None, float(clamp) if clamp is not None else -1.0,
        found_inf.data_ptr() if found_inf is not None else None, check.data_ptr() if check is not None else None,
        counts, len(counts), native.threads_for(_state.get("threading")), GRAIN, first_unit,
    )  # fmt: skip
    del held


def _reset_for_tests() -> None:
    _state.clear()


__all__ = [
    "Adam8bitPiece", "adam8bit_step", "adam8bit_step_pieces", "counts_of", "cpu_kernel", "piece_row", "row_array",
    "run_rows", "tensors_of", "threading_model",
]  # fmt: skip
