"""The one-pass lean update, compiled: a C kernel on the CPU (this package), a Triton kernel on CUDA (:mod:`.cuda`).

On the CPU, ``lean_update.c`` (plain C, no torch headers) is compiled with the system's C compiler the first time a
process needs it (about a second), into a cache keyed by the source, the compiler and the CPU's flags
(``$LIGHTNING_MP_CACHE``, default ``~/.cache/lightning_mp``), and loaded with :mod:`ctypes`. Where it cannot be
built (no C compiler, a compiler error) or loaded, :func:`cpu_kernel` returns ``None`` after one warning that says
why, and the step falls back to the chunked path (:mod:`lightning_mp.master.lean.chunked`): slower, the same bits.
``LIGHTNING_MP_NATIVE=0`` turns the compiled kernels off (the fallback on purpose).

Threads: built with OpenMP where the compiler has it, the kernel's parallel work runs on the OpenMP thread pool of
the calling thread, *the same pool torch's CPU ops use* (torch's build loads its ``libgomp.so.1`` first, and the
kernel's reference to that name resolves to it): the threads that just ran a matmul take the update's units at once.
Threads of its own (``pthread_create`` per call, the build without OpenMP) competed with torch's OpenMP workers,
which spin-wait for a while after each parallel region and hold the other cores: inside backward a two-thread update
made the step 1.56x slower than one thread, while on torch's pool it runs at the normal step's speed
(``benchmarks/RESULTS.md``, "The step inside backward on torch's OpenMP threads"). Where the OpenMP build would
bring a second OpenMP runtime into the process (torch built with another one) or cannot be built, the kernel is
built without OpenMP; ``LIGHTNING_MP_OPENMP=0`` chooses that build on purpose. The threads never change a result:
each element's arithmetic is the same whichever thread computes it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from lightning_mp.kernels.options import ADAM, ADAMW, OPTION_FIELDS, SGD, c_declarations

SOURCE = Path(__file__).with_name("lean_update.c")
#: The exact join and split, put into every kernel's source (:func:`compose`).
BITS = Path(__file__).with_name("lean_bits.h")
#: The 8-bit kernel's code search, put into ``lean_adam8bit.c`` (:func:`compose`).
CODE_SEARCH = Path(__file__).with_name("lean_code_search.h")
#: Flags: vectorised loops for this CPU, and no fused multiply-add but the ones the source asks for (exactness).
CFLAGS = [
    "-O3",
    "-march=native",
    "-mprefer-vector-width=256",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fPIC",
    "-shared",
    "-pthread",
]
#: Added where the compiler has OpenMP: the kernel's threads are then the OpenMP threads torch's own CPU ops run on
#: (:func:`cpu_kernel`), not threads of its own.
OPENMP_FLAGS = ["-fopenmp"]
#: Elements per unit of work handed to a thread (a multiple of every vector width).
GRAIN = 1 << 16
#: The vector width of torch's fused CPU optimizer kernels, in floats.
VEC_SIZE = 8

_state: dict[str, Any] = {}


class Piece(ctypes.Structure):
    """One tensor's part of an update (mirrors ``lean_piece`` in ``lean_update.c``)."""

    _fields_ = [
        ("high", ctypes.c_void_p),
        ("low", ctypes.c_void_p),
        ("grad", ctypes.c_void_p),
        ("state1", ctypes.c_void_p),
        ("state2", ctypes.c_void_p),
        ("state3", ctypes.c_void_p),
        ("step", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("grad_fp32", ctypes.c_int),
    ]


class Options(ctypes.Structure):
    """The optimizer's options for one update (:data:`~lightning_mp.kernels.options.OPTION_FIELDS`: the C source's
    ``lean_options``)."""

    _fields_ = [(name, ctype) for name, _, ctype, _ in OPTION_FIELDS]


def compose(text: str) -> str:
    """A kernel's C source as compiled: the line ``LEAN_DECLARATIONS`` replaced by
    :func:`~lightning_mp.kernels.options.c_declarations`, the line ``LEAN_BITS`` by ``lean_bits.h`` (the exact join
    and split, one definition for every kernel), the line ``LEAN_CODE_SEARCH`` by ``lean_code_search.h`` (the 8-bit
    kernel's code search), where the source has them."""
    if "\nLEAN_DECLARATIONS\n" in text:
        text = text.replace("\nLEAN_DECLARATIONS\n", "\n" + c_declarations() + "\n", 1)
    for line, path in (("LEAN_BITS", BITS), ("LEAN_CODE_SEARCH", CODE_SEARCH)):
        if f"\n{line}\n" in text:
            text = text.replace(f"\n{line}\n", "\n" + path.read_text() + "\n", 1)
    return text


def source_text() -> str:
    """``lean_update.c`` as compiled (:func:`compose`)."""
    text = SOURCE.read_text()
    if "\nLEAN_DECLARATIONS\n" not in text or "\nLEAN_BITS\n" not in text:
        raise RuntimeError(f"{SOURCE.name} lacks the LEAN_DECLARATIONS or LEAN_BITS line its build fills in")
    return compose(text)


class Call(ctypes.Structure):
    """One parameter's step, laid out once (mirrors ``lean_call``): only ``grad`` is written per call
    (:func:`prepare_call`, :func:`step_call`)."""

    _fields_ = [
        ("pieces", ctypes.POINTER(Piece)),
        ("grad_fp32", ctypes.c_void_p),
        ("options", ctypes.POINTER(Options)),
        ("found_inf", ctypes.c_void_p),
        ("counts", ctypes.c_void_p),
        ("ncounts", ctypes.c_int64),
        ("settle", ctypes.c_int),
        ("threads", ctypes.c_int),
        ("grain", ctypes.c_int64),
        ("first_unit", ctypes.c_void_p),
        ("grad", ctypes.c_void_p),
        ("numel", ctypes.c_int64),
        ("check_width", ctypes.c_int),
        ("exponent_mask", ctypes.c_uint32),
    ]


def enabled() -> bool:
    """Whether compiled kernels may be used (``LIGHTNING_MP_NATIVE=0`` turns them off)."""
    return os.environ.get("LIGHTNING_MP_NATIVE", "1") != "0"


def cache_dir() -> Path:
    """Where built kernels are kept: ``$LIGHTNING_MP_CACHE``, else ``~/.cache/lightning_mp``."""
    root = os.environ.get("LIGHTNING_MP_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lightning_mp")
    return Path(root)


def find_compiler() -> Optional[str]:
    """The C compiler to build with: ``$CC``, else ``cc``, ``gcc`` or ``clang``, whichever is found first."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_key() -> str:
    """The CPU's identity for the cache: a kernel built with ``-march=native`` must not run on another CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build(name: str, source: bytes, compiler: str, flags: list[str]) -> Path:
    """The shared library of the C ``source`` built with ``compiler`` and ``flags`` into the cache, keyed by the
    source, the flags, the compiler's version and the CPU's flags (``<name>-<key>.so``); built once, then reused.
    Raises ``RuntimeError`` with the compiler's message where it fails. (The 8-bit kernel of :mod:`.adam8bit` is
    built here too.)"""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), version.encode(), _cpu_key().encode()]))
    target = cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: ranks of one job may build at the same time
    fd, scratch = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    fd, generated = tempfile.mkstemp(suffix=".c", dir=target.parent)
    with os.fdopen(fd, "wb") as out:
        out.write(source)
    try:
        done = subprocess.run(
            [compiler, *flags, generated, "-o", scratch, "-lm"], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(scratch, target)
    finally:
        for path in (scratch, generated):
            if os.path.exists(path):
                os.unlink(path)
    return target


def _build(compiler: str, flags: list[str]) -> Path:
    return build("lean_update", source_text().encode(), compiler, flags)


def openmp_runtimes() -> set[str]:
    """The files of the OpenMP runtimes loaded in this process (GNU ``libgomp``, LLVM ``libomp``, Intel
    ``libiomp5``), from ``/proc/self/maps``; empty where it cannot be read."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    return set(re.findall(r"(/\S*/lib(?:gomp|iomp5|omp)[^/\s]*\.so[.\d]*)$", maps, flags=re.MULTILINE))


def load_openmp(build_with: Callable[[list[str]], Path]) -> Optional[ctypes.CDLL]:
    """The OpenMP build (``build_with(flags)``), loaded, where it builds and shares the one OpenMP runtime torch
    already loaded (module doc); ``None`` otherwise (the caller builds the one without OpenMP)."""
    if os.environ.get("LIGHTNING_MP_OPENMP", "1") == "0":
        return None
    before = openmp_runtimes()
    if not before:  # torch runs no OpenMP runtime here (or the maps cannot be read): no pool to share
        return None
    try:
        path = build_with(CFLAGS + OPENMP_FLAGS)
    except RuntimeError:  # a compiler without OpenMP (clang without libomp): the build without it
        return None
    library = ctypes.CDLL(str(path))
    if openmp_runtimes() != before:  # it brought a second runtime, a pool of its own: not loaded for use
        return None
    return library


def threading_model() -> Optional[str]:
    """``"openmp"`` (torch's OpenMP threads), ``"pthreads"`` (threads of its own) or ``None`` (no compiled kernel)."""
    library = cpu_kernel()
    return None if library is None else _state.get("threading")


def cpu_kernel() -> Optional[ctypes.CDLL]:
    """The compiled CPU kernel (built on first use), or ``None`` (one warning) where it cannot be built."""
    if "cpu" in _state:
        return _state["cpu"]
    library = None
    if enabled():
        compiler = find_compiler()
        try:
            if compiler is None:
                raise RuntimeError("no C compiler found (looked for $CC, cc, gcc, clang)")
            library = load_openmp(lambda flags: _build(compiler, flags))
            _state["threading"] = "openmp" if library is not None else "pthreads"
            if library is None:
                library = ctypes.CDLL(str(_build(compiler, CFLAGS)))
            library.lean_update.restype = ctypes.c_int
            library.lean_update.argtypes = [
                ctypes.POINTER(Piece),
                ctypes.c_int64,
                ctypes.POINTER(Options),
                ctypes.c_void_p,
                ctypes.c_int,
                ctypes.c_int64,
                ctypes.POINTER(ctypes.c_int64),
            ]
            library.lean_step.restype = ctypes.c_int
            library.lean_step.argtypes = [
                ctypes.POINTER(Piece),
                ctypes.c_int64,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.POINTER(Options),
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_int64,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int64,
                ctypes.POINTER(ctypes.c_int64),
            ]
            library.lean_step_call.restype = ctypes.c_int
            library.lean_step_call.argtypes = [ctypes.POINTER(Call)]
            library.lean_settle.restype = None
            library.lean_settle.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
            library.lean_check_nonfinite.restype = None
            library.lean_check_nonfinite.argtypes = [
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_int64,
                ctypes.c_int,
                ctypes.c_uint32,
                ctypes.c_void_p,
                ctypes.c_int,
                ctypes.c_int64,
                ctypes.POINTER(ctypes.c_int64),
            ]
            for name in ("lean_join", "lean_split"):
                getattr(library, name).restype = None
                getattr(library, name).argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64]
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            warnings.warn(
                f"lightning_mp: the one-pass lean-master update could not be built ({error}); lean masters fall back "
                "to the chunked update (the same results, slower). Install a C compiler (gcc or clang) to get it, "
                "or set LIGHTNING_MP_NATIVE=0 to silence this.",
                RuntimeWarning,
                stacklevel=2,
            )
            library = None
    _state["cpu"] = library
    return library


def vec_size() -> int:
    """Floats per vector in torch's fused optimizer kernels (where a tensor's scalar tail begins): 8, measured on
    torch 2.13 with AVX512 and AVX2 (tests/test_native_update.py checks it against torch's kernel)."""
    return VEC_SIZE


_local = threading.local()  # .threads: this thread's cap on the CPU kernel's threads (see inside_backward)


def backward_threads() -> int:
    """How many threads the CPU kernels use inside backward (the step inside backward): torch's, on torch's OpenMP
    threads (the OpenMP build: they take the work between autograd's ops); one with threads of their own (the
    build without OpenMP), which competed there with torch's spin-waiting OpenMP workers (measured on 2 cores: 39
    calls inside backward 27-48 ms with 2 threads, 7-14 ms with 1)."""
    return torch.get_num_threads() if _state.get("threading") == "openmp" else 1


class inside_backward:  # a context manager: `with inside_backward():`
    """Within the block the CPU kernels (update and check) use :func:`backward_threads` threads. A class, not a
    generator: it is entered once per parameter inside backward, where contextlib's cost showed."""

    __slots__ = ("before",)

    def __enter__(self) -> None:
        self.before = getattr(_local, "threads", None)
        _local.threads = backward_threads()

    def __exit__(self, *exc: object) -> None:
        _local.threads = self.before


def threads() -> int:
    """How many threads the CPU kernels may use here: :func:`backward_threads` inside :class:`inside_backward`, else
    torch's."""
    return getattr(_local, "threads", None) or torch.get_num_threads()


def threads_for(threading: Optional[str]) -> int:
    """:func:`threads` for a kernel built with ``threading`` (``"openmp"``: torch's pool; else threads of its own), a
    library other than this module's (the 8-bit kernel): inside :class:`inside_backward` torch's count on torch's
    OpenMP pool, one with threads of its own (:func:`backward_threads`' reason); elsewhere torch's."""
    if getattr(_local, "threads", None) is None:
        return torch.get_num_threads()
    return torch.get_num_threads() if threading == "openmp" else 1


def run(pieces: list[Piece], options: Options, found_inf: Optional[torch.Tensor]) -> None:
    """One update of ``pieces`` on the CPU (the kernel must be built: :func:`cpu_kernel`), each gradient of the
    dtype ``options.grad_fp32`` says."""
    library = _state["cpu"]
    for piece in pieces:
        piece.grad_fp32 = options.grad_fp32
    array = (Piece * len(pieces))(*pieces)
    first_unit = (ctypes.c_int64 * (len(pieces) + 1))()
    flag = found_inf.data_ptr() if found_inf is not None else None
    library.lean_update(array, len(pieces), ctypes.byref(options), flag, threads(), GRAIN, first_unit)


def run_rows(
    rows: list[list[int]],
    steps: Optional[list[torch.Tensor]],
    options: dict[str, Any],
    factor: Optional[torch.Tensor],
    found: Optional[torch.Tensor],
) -> None:
    """One update on the CPU of the tensors whose addresses ``rows`` holds (``[high, low, grad, state1, state2,
    state3, numel]`` each), ``steps`` their step counts (Adam) or ``None`` (SGD), ``options`` the optimizer's."""
    pieces = [
        Piece(*(address or None for address in row[:6]), steps[i].data_ptr() if steps else None, row[6])
        for i, row in enumerate(rows)
    ]
    fields = Options(**{name: value for name, value in options.items() if name != "grad_mul"})
    fields.grad_mul = factor.data_ptr() if factor is not None else None
    fields.vec_size = vec_size()
    run(pieces, fields, found)


def cuda_one_pass() -> bool:
    """Whether the CUDA one-pass kernel may run: the default; ``LIGHTNING_MP_CUDA_ONE_PASS=0`` turns it off on CUDA
    alone (the chunked path, bitwise torch's CUDA kernel, runs instead)."""
    return os.environ.get("LIGHTNING_MP_CUDA_ONE_PASS", "1") != "0"


def cuda_kernel() -> Optional[Any]:
    """The CUDA one-pass update's module (:mod:`.cuda`), or ``None`` (one warning) where Triton is missing."""
    if "cuda" not in _state:
        from lightning_mp.kernels import cuda

        _state["cuda"] = cuda if cuda.triton_available() else None
        if _state["cuda"] is None and enabled():
            warnings.warn(
                "lightning_mp: Triton is not installed, so the one-pass lean-master update cannot run on CUDA; lean "
                "masters fall back to the chunked update (the same results, slower). CUDA builds of torch ship "
                "Triton; set LIGHTNING_MP_NATIVE=0 to silence this.",
                RuntimeWarning,
                stacklevel=2,
            )
    return _state["cuda"]


def cuda_update(owner: object) -> Any:
    """The CUDA update's caches (program and address tables) kept for ``owner`` (a lean store)."""
    updates = _state.setdefault("cuda_updates", weakref.WeakKeyDictionary())
    if owner not in updates:
        updates[owner] = _state["cuda"].CudaLeanUpdate()
    return updates[owner]


#: exponent bits per dtype: all ones means inf or NaN
_EXPONENT_MASKS = {torch.bfloat16: (2, 0x7F80), torch.float16: (2, 0x7C00), torch.float32: (4, 0x7F800000)}


def check_nonfinite(grads: list[torch.Tensor], found: torch.Tensor) -> bool:
    """Set ``found`` (a 1-element fp32 CPU tensor) to 1 if any of ``grads`` (one dtype, contiguous CPU tensors)
    holds an inf or NaN, reading them only; ``False`` (nothing done) where the kernel cannot take them."""
    library = cpu_kernel() if enabled() else None
    if library is None or not grads or grads[0].dtype not in _EXPONENT_MASKS:
        return False
    if not all(g.device.type == "cpu" and g.is_contiguous() and g.dtype == grads[0].dtype for g in grads):
        return False
    width, mask = _EXPONENT_MASKS[grads[0].dtype]
    pointers = (ctypes.c_void_p * len(grads))(*[g.data_ptr() for g in grads])
    numels = (ctypes.c_int64 * len(grads))(*[g.numel() for g in grads])
    first_unit = (ctypes.c_int64 * (len(grads) + 1))()
    library.lean_check_nonfinite(
        pointers, numels, len(grads), width, mask, found.data_ptr(), threads(), GRAIN, first_unit
    )
    return True


def prepare_call(
    pieces: Any,
    grad_fp32: Any,
    options: Options,
    found: Optional[torch.Tensor],
    counts: Any,
    ncounts: int,
    first_unit: Any,
    numel: int,
    check: Optional[torch.dtype],
) -> Optional[Call]:
    """The :class:`Call` of one piece's step inside backward, on :func:`backward_threads` threads (``pieces``,
    ``grad_fp32``, ``counts`` and ``first_unit`` a plan's ctypes arrays, ``options`` held by the caller), the settle
    included; with ``check`` (the gradient's dtype) the gradient's non-finite check into ``found`` first. ``None``
    where the check cannot be made by the kernel (another dtype)."""
    width, mask = _EXPONENT_MASKS.get(check, (0, 0)) if check is not None else (0, 0)
    if check is not None and not width:
        return None
    return Call(
        pieces, ctypes.addressof(grad_fp32), ctypes.pointer(options), found.data_ptr() if found is not None else None,
        ctypes.addressof(counts) if counts is not None else None, ncounts if counts is not None else 0, 1,
        backward_threads(), GRAIN,
        ctypes.addressof(first_unit), None, numel, width, mask,
    )  # fmt: skip


def join(high: torch.Tensor, low: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (fp32, contiguous) = the join of ``high`` (bf16) and ``low`` (int16), one pass."""
    _state["cpu"].lean_join(high.data_ptr(), low.data_ptr(), out.data_ptr(), out.numel())
    return out


def split(values: torch.Tensor, high: torch.Tensor, low: torch.Tensor) -> None:
    """``high``, ``low`` = the split of ``values`` (fp32, contiguous), one pass."""
    _state["cpu"].lean_split(values.data_ptr(), high.data_ptr(), low.data_ptr(), values.numel())


def _reset_for_tests() -> None:
    _state.clear()


__all__ = [
    "ADAM",
    "ADAMW",
    "SGD",
    "Options",
    "Piece",
    "cpu_kernel",
    "cuda_kernel",
    "cuda_update",
    "enabled",
    "join",
    "run",
    "run_rows",
    "split",
    "vec_size",
]
