"""The one-pass lean update (lightning_mp.kernels.native, .onepass): bitwise torch's fused kernels, flag by flag, and
the fallback to the chunked path when the kernel cannot be built."""

from __future__ import annotations

import copy
import itertools
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from lightning_mp.kernels import contract, native
from lightning_mp.kernels.bits import join_fp32, split_fp32
from lightning_mp.master import RemainderMasters
from lightning_mp.master.lean import plan

# tensor sizes: vector body only, tail only (< 8), body + tail, several threads' units (> native.GRAIN)
SIZES = [64, 7, 1003, native.GRAIN * 2 + 13]

ADAM_FLAGS = [
    dict(decoupled=True, weight_decay=0.01),
    dict(decoupled=True, weight_decay=0.0, amsgrad=True),
    dict(decoupled=False, weight_decay=0.1, maximize=True),
    dict(decoupled=False, weight_decay=0.0, betas=(0.3, 0.99)),  # beta1 < 0.5: the lerp's other branch
    dict(decoupled=True, weight_decay=0.05, amsgrad=True, maximize=True, betas=(0.2, 0.9)),
]
SGD_FLAGS = [
    dict(momentum=0.9, nesterov=True, weight_decay=1e-3),
    dict(momentum=0.9, dampening=0.1, weight_decay=0.01),
    dict(momentum=0.0, weight_decay=0.0, maximize=True),
    dict(momentum=0.5, weight_decay=0.0),
]


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if native.cpu_kernel() is None:
        pytest.skip("no C compiler here: the fallback is tested below")


def _lean_values(generator, sizes):
    values = [torch.randn(n, generator=generator) * 0.05 for n in sizes]
    halves = [split_fp32(v) for v in values]
    return halves, [join_fp32(h, lo).clone() for h, lo in halves]


def _grads(generator, sizes, dtype):
    return [(torch.randn(n, generator=generator) * 1e-2).to(dtype) for n in sizes]


def _equal_bits(halves, reference):
    for (high, low), ref in zip(halves, reference):
        got = join_fp32(high, low)
        assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), (got - ref).abs().max()


def _ops(clip):
    """Options' clipping fields and the same clipping applied to a reference gradient."""
    if clip == "norm":
        factor = torch.tensor(0.37)
        return dict(grad_mul=factor.data_ptr()), (lambda g: g * factor), factor
    if clip == "value":
        return dict(clamp=0.004, clamped=1), (lambda g: g.clamp_min(-0.004).clamp_max(0.004)), None
    return dict(clamp=-1.0), (lambda g: g), None


@pytest.mark.parametrize(
    ("flags", "grad_dtype", "clip"),
    list(itertools.product(ADAM_FLAGS, [torch.bfloat16, torch.float32], ["none", "norm", "value"])),
)
def test_adam_one_pass_is_bitwise_torchs_fused_kernel(flags, grad_dtype, clip):
    """Four steps (the moments grow from zero), every element: body, tail, and units split over threads."""
    generator = torch.Generator().manual_seed(0)
    halves, reference = _lean_values(generator, SIZES)
    amsgrad, betas = flags.get("amsgrad", False), flags.get("betas", (0.9, 0.999))
    states = [[torch.zeros(n) for n in SIZES] for _ in range(3)]
    ref_states = [[torch.zeros(n) for n in SIZES] for _ in range(3)]
    steps, ref_steps = [torch.tensor(0.0) for _ in SIZES], [torch.tensor(0.0) for _ in SIZES]
    fields, clip_ref, keep = _ops(clip)
    kernel = torch._fused_adamw_ if flags["decoupled"] else torch._fused_adam_
    for _ in range(4):
        grads = _grads(generator, SIZES, grad_dtype)
        torch._foreach_add_(steps, 1)
        torch._foreach_add_(ref_steps, 1)
        kernel(
            reference, [clip_ref(g.float()) for g in grads], ref_states[0], ref_states[1],
            ref_states[2] if amsgrad else [], ref_steps, amsgrad=amsgrad, lr=1e-2, beta1=betas[0], beta2=betas[1],
            weight_decay=flags["weight_decay"], eps=1e-8, maximize=flags.get("maximize", False), grad_scale=None,
            found_inf=None,
        )  # fmt: skip
        options = native.Options(
            kind=native.ADAMW if flags["decoupled"] else native.ADAM, grad_fp32=int(grad_dtype == torch.float32),
            amsgrad=int(amsgrad), maximize=int(flags.get("maximize", False)), lr=1e-2, beta1=betas[0],
            beta2=betas[1], weight_decay=flags["weight_decay"], eps=1e-8, vec_size=native.vec_size(), **fields,
        )  # fmt: skip
        pieces = [
            native.Piece(
                h.data_ptr(), lo.data_ptr(), g.data_ptr(), a.data_ptr(), b.data_ptr(), c.data_ptr(), s.data_ptr(), n
            )  # fmt: skip
            for (h, lo), g, a, b, c, s, n in zip(halves, grads, *states, steps, SIZES)
        ]
        native.run(pieces, options, None)
    _equal_bits(halves, reference)
    for ours, theirs in zip(states, ref_states):
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)
    del keep


@pytest.mark.parametrize(
    ("flags", "grad_dtype", "clip"),
    list(itertools.product(SGD_FLAGS, [torch.bfloat16, torch.float32], ["none", "norm"])),
)
def test_sgd_one_pass_is_bitwise_torchs_fused_kernel(flags, grad_dtype, clip):
    generator = torch.Generator().manual_seed(1)
    halves, reference = _lean_values(generator, SIZES)
    momentum = flags["momentum"]
    buffers, ref_buffers = [torch.zeros(n) for n in SIZES], [torch.zeros(n) for n in SIZES]
    fields, clip_ref, keep = _ops(clip)
    for step in range(4):
        grads = _grads(generator, SIZES, grad_dtype)
        torch._fused_sgd_(
            reference, [clip_ref(g.float()) for g in grads], ref_buffers if momentum else [],
            weight_decay=flags["weight_decay"], momentum=momentum, lr=1e-2, dampening=flags.get("dampening", 0.0),
            nesterov=flags.get("nesterov", False), maximize=flags.get("maximize", False), is_first_step=step == 0,
            grad_scale=None, found_inf=None,
        )  # fmt: skip
        options = native.Options(
            kind=native.SGD, grad_fp32=int(grad_dtype == torch.float32), maximize=int(flags.get("maximize", False)),
            nesterov=int(flags.get("nesterov", False)), first_step=int(step == 0), lr=1e-2,
            weight_decay=flags["weight_decay"], momentum=momentum, dampening=flags.get("dampening", 0.0),
            vec_size=native.vec_size(), **fields,
        )  # fmt: skip
        pieces = [
            native.Piece(
                h.data_ptr(), lo.data_ptr(), g.data_ptr(), b.data_ptr() if momentum else None, None, None, None, n
            )  # fmt: skip
            for (h, lo), g, b, n in zip(halves, grads, buffers, SIZES)
        ]
        native.run(pieces, options, None)
    _equal_bits(halves, reference)
    if momentum:
        for a, b in zip(buffers, ref_buffers):
            assert torch.equal(a, b)
    del keep


def test_found_inf_leaves_every_byte_as_it_was():
    generator = torch.Generator().manual_seed(2)
    halves, _ = _lean_values(generator, SIZES)
    before = [(h.clone(), lo.clone()) for h, lo in halves]
    moments = [torch.ones(n) for n in SIZES]
    step = torch.tensor(1.0)
    grads = _grads(generator, SIZES, torch.bfloat16)
    options = native.Options(kind=native.ADAMW, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, clamp=-1.0, vec_size=8)
    pieces = [
        native.Piece(h.data_ptr(), lo.data_ptr(), g.data_ptr(), m.data_ptr(), m.data_ptr(), None, step.data_ptr(), n)
        for (h, lo), g, m, n in zip(halves, grads, moments, SIZES)
    ]
    native.run(pieces, options, torch.tensor(1.0))
    for (h, lo), (h0, l0) in zip(halves, before):
        assert torch.equal(h.view(torch.int16), h0.view(torch.int16)) and torch.equal(lo, l0)
    assert all(torch.equal(m, torch.ones_like(m)) for m in moments)


def _check(grads):
    flag = torch.zeros(1)
    assert native.check_nonfinite(grads, flag)  # the compiled check took them
    return flag.item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_compiled_check_finds_every_non_finite_16_bit_pattern_and_no_finite_one(dtype):
    """Every one of the 65536 bit patterns: all finite ones together read as finite (the largest finite magnitude
    of either sign included), and each inf or NaN pattern alone, after them, is found."""
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = torch.isfinite(patterns.float())
    assert _check([patterns[finite].contiguous()]) == 0.0
    bad = patterns[~finite]
    assert len(bad) == {torch.bfloat16: 256, torch.float16: 2048}[dtype]  # 2 signs x (inf + every NaN payload)
    some_finite = patterns[finite][:100].contiguous()
    for value in bad:
        assert _check([some_finite, value.reshape(1).clone()]) == 1.0, value.view(torch.int16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_compiled_check_finds_one_bad_value_wherever_it_is_among_units_and_tensors(monkeypatch, dtype):
    """Units of GRAIN values cut across tensors (one large tensor is shared by the threads): one bad value in the
    first, a middle or the last unit of a tensor, or in a small tensor after a large one, is found; the largest
    finite value and its negative are not."""
    sizes = [native.GRAIN * 3 + 5, 9, native.GRAIN + 1]
    largest = torch.finfo(dtype).max
    for threads in (1, 2, 3):
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)  # what the check reads
        clean = [torch.randn(n).to(dtype) for n in sizes]
        clean[0][native.GRAIN] = largest
        clean[2][-1] = -largest
        assert _check(clean) == 0.0
        for tensor, index in [(0, 0), (0, native.GRAIN + 7), (0, sizes[0] - 1), (1, 4), (2, native.GRAIN)]:
            for bad in (float("inf"), float("-inf"), float("nan")):
                grads = [g.clone() for g in clean]
                grads[tensor][index] = bad
                assert _check(grads) == 1.0, (threads, tensor, index, bad)


def test_join_and_split_kernels_equal_the_eager_ones_on_special_values():
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -1e-45, 3.4e38, -3.4e38])
    values = torch.cat([special, torch.randn(5000) * 10.0 ** torch.randint(-30, 30, (5000,)).float()])
    high, low = torch.empty(values.shape, dtype=torch.bfloat16), torch.empty(values.shape, dtype=torch.int16)
    native.split(values, high, low)
    eager_high, eager_low = split_fp32(values)
    assert torch.equal(high.view(torch.int16), eager_high.view(torch.int16)) and torch.equal(low, eager_low)
    joined = native.join(high, low, torch.empty_like(values))
    assert torch.equal(joined.view(torch.int32), join_fp32(eager_high, eager_low).view(torch.int32))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 300), nn.LayerNorm(300), nn.Linear(300, 7))


def _train(model, optimizer_cls, kwargs, clip=None, steps=3):
    store = RemainderMasters()
    store.convert(model)
    optimizer = optimizer_cls(model.parameters(), **kwargs)
    store.attach([optimizer])
    generator = torch.Generator().manual_seed(3)
    for _ in range(steps):
        for p in model.parameters():
            p.grad = (torch.randn(p.shape, generator=generator) * 1e-2).to(p.dtype)
        if clip == "norm":
            store.clip_grad_norm_(optimizer, 0.01)
        elif clip == "value":
            store.clip_grad_value_(optimizer, 1e-3)
        store.fused_step(optimizer, None)
    return [store.fp32_value(p) for p in model.parameters()]


@pytest.mark.parametrize("clip", [None, "norm", "value"])
@pytest.mark.parametrize(
    ("optimizer_cls", "kwargs"),
    [(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)), (torch.optim.SGD, dict(lr=1e-2, momentum=0.9))],
)
def test_one_pass_and_chunked_paths_give_the_same_bits(monkeypatch, optimizer_cls, kwargs, clip):
    """The store's step with the kernel, and with it turned off (LIGHTNING_MP_NATIVE=0): one result."""
    model = _mlp()
    chunked_model = copy.deepcopy(model)
    one_pass = _train(model, optimizer_cls, kwargs, clip)
    monkeypatch.setenv("LIGHTNING_MP_NATIVE", "0")
    assert plan.clipping_for(list(chunked_model.parameters()), []) is None
    chunked = _train(chunked_model, optimizer_cls, kwargs, clip)
    for a, b in zip(one_pass, chunked):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_no_compiler_warns_once_and_falls_back_to_the_chunked_path(monkeypatch):
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "find_compiler", lambda: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values = _train(_mlp(), torch.optim.AdamW, dict(lr=1e-2))
        _train(_mlp(), torch.optim.AdamW, dict(lr=1e-2))
    messages = [str(w.message) for w in caught if "one-pass" in str(w.message)]
    assert len(messages) == 1 and "no C compiler found" in messages[0] and "chunked update" in messages[0]
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.undo()
    expected = _train(_mlp(), torch.optim.AdamW, dict(lr=1e-2))
    assert all(torch.equal(a, b) for a, b in zip(values, expected))


def test_a_compiler_error_names_itself_and_falls_back(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("LIGHTNING_MP_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "CFLAGS", [*native.CFLAGS, "-fno-such-flag-for-this-test"])
    with pytest.warns(RuntimeWarning, match="could not be built.*failed"):
        assert native.cpu_kernel() is None
    monkeypatch.setattr(native, "_state", {})


def test_the_kernel_is_built_once_and_then_loaded_from_the_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("LIGHTNING_MP_CACHE", str(tmp_path))
    assert native.cpu_kernel() is not None
    built = list(tmp_path.glob("lean_update-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(native, "_state", {})
    assert native.cpu_kernel() is not None
    assert [p.stat().st_mtime_ns for p in tmp_path.glob("lean_update-*.so")] == [stamp]
    monkeypatch.setattr(native, "_state", {})


def test_the_kernel_runs_on_torchs_own_openmp_threads_where_torch_has_them(monkeypatch, tmp_path):
    """The OpenMP build shares the one OpenMP runtime torch loaded (its pool of threads), never a second one."""
    runtimes = native.openmp_runtimes()
    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info() or not runtimes:
        pytest.skip("torch runs no OpenMP runtime here: the kernel is built with threads of its own")
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setenv("LIGHTNING_MP_CACHE", str(tmp_path))
    compiler = native.find_compiler()
    try:
        native._build(compiler, native.CFLAGS + native.OPENMP_FLAGS)
    except (TypeError, RuntimeError) as error:  # no compiler, or one without OpenMP: the other build is tested below
        pytest.skip(f"the kernel cannot be built with OpenMP here: {error}")
    assert native.threading_model() == "openmp" and native.backward_threads() == torch.get_num_threads()
    assert native.openmp_runtimes() == runtimes  # no second runtime: torch's pool runs the kernel's units
    monkeypatch.setenv("LIGHTNING_MP_OPENMP", "0")  # the build without OpenMP, on purpose
    monkeypatch.setattr(native, "_state", {})
    assert native.threading_model() == "pthreads" and native.backward_threads() == 1
    monkeypatch.setattr(native, "_state", {})


def test_both_builds_are_bitwise_torchs_kernel_with_the_work_shared_by_two_threads():
    """Threads never change a result: each build, in a fresh process, with tensors of several units of GRAIN shared
    by two threads, gives torch's fused kernel's bits on every configuration of the contract."""
    script = (
        "import torch; torch.set_num_threads(2)\n"
        "from lightning_mp.kernels import contract, native\n"
        "assert native.threads() == 2, native.threads()\n"
        "for kind, flags in contract.CASES:\n"
        "    found = contract.measure(kind, flags, torch.device('cpu'), 'cpu', sizes=(5 * native.GRAIN + 3, 7), seeds=1)\n"
        "    assert found['differ'] == 0 and found['ours'] == found['torch'], (kind, flags, found)\n"
        "print(native.threading_model())\n"
    )
    models = []
    for openmp in ("1", "0"):
        env = {**os.environ, "LIGHTNING_MP_OPENMP": openmp}
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        models.append(done.stdout.strip().splitlines()[-1])
    assert models[1] == "pthreads" and models[0] in ("openmp", "pthreads")


# ---------------------------------------------------------------- CUDA (Triton): the contract of native/contract.py
# (b): each value the kernel writes is as close to a float64 evaluation of the optimizer's formula as torch's own
# fused kernel's on the same device (at least 1 ulp of slack); every flag, both gradient dtypes.
CONTRACT_CASES = [
    pytest.param(kind, flags, grad_dtype, id=f"{contract.case_name(kind, flags)}-{str(grad_dtype)[6:]}")
    for grad_dtype in (torch.bfloat16, torch.float32)
    for kind, flags in contract.CASES
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("kind", "flags", "grad_dtype"), CONTRACT_CASES)
def test_cuda_one_pass_is_as_close_to_float64_as_torchs_cuda_kernel(kind, flags, grad_dtype):
    found = contract.measure(kind, flags, torch.device("cuda"), "triton", grad_dtype, sizes=(1 << 16, 4099, 7))
    print(f"ULPS {contract.case_name(kind, flags)} {grad_dtype}: {found}")
    assert found["ours"] <= contract.bound(found["torch"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test above runs the compiled kernel")
@pytest.mark.parametrize(("kind", "flags", "grad_dtype"), CONTRACT_CASES)
def test_cuda_kernel_under_tritons_interpreter_is_as_close_to_float64_as_torchs_kernel(
    monkeypatch, kind, flags, grad_dtype
):
    """Where Triton is installed without a GPU: the same kernel, interpreted, against torch's fused CPU kernel."""
    pytest.importorskip("triton", reason="Triton is not installed here (CUDA builds of torch ship it)")
    from lightning_mp.kernels import cuda

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(cuda, "_kernels", {})
    found = contract.measure(kind, flags, torch.device("cpu"), "triton", grad_dtype, sizes=(1 << 13, 1 << 13, 7))
    assert found["ours"] <= contract.bound(found["torch"])


def test_the_c_kernel_is_bitwise_torchs_cpu_kernel_so_within_the_contract():
    """(c) implies (b) on the CPU: the same distance from float64 as torch's kernel, every value's bits equal."""
    for kind, flags in contract.CASES:
        found = contract.measure(kind, flags, torch.device("cpu"), "cpu", sizes=(4096, 7, 1003), seeds=1)
        assert found["differ"] == 0 and found["ours"] == found["torch"], (kind, flags, found)


def test_float64_reference_agrees_with_torchs_kernel_to_a_few_ulps():
    """The reference itself: torch's fused CPU kernel lands within a few dozen ulps of it on every configuration (a
    wrong formula would be off by the size of a term, millions of ulps)."""
    for kind, flags in contract.CASES:
        weights, grads, states = contract.random_inputs(kind, flags, [2048], torch.float32, 0)
        reference, _ = contract.float64_step(kind, flags, weights, grads, states)
        stepped = [w.clone() for w in weights]
        contract.torch_step(kind, flags, stepped, grads, [[t.clone() for t in s] for s in states])
        assert contract.ulps(stepped[0], reference[0], weights[0]) < 64, (kind, flags)


def test_a_bad_triton_launch_config_names_the_value_and_the_allowed_form(monkeypatch):
    from lightning_mp.kernels import cuda

    for text in ("1000,1024,4", "1024,512,4", "1024,2048", "a,b,c", "1024,2048,4,2"):
        monkeypatch.setenv("LIGHTNING_MP_TRITON_CONFIG", text)
        with pytest.raises(ValueError, match=f"LIGHTNING_MP_TRITON_CONFIG='{text}'.*powers of two"):
            cuda.launch_config()
    monkeypatch.setenv("LIGHTNING_MP_TRITON_CONFIG", "2048,8192,8,1")
    assert cuda.launch_config() == cuda.LaunchConfig(2048, 8192, 8, True)


def test_the_bias_kernel_forms_adams_bias_terms_from_the_step_counts_on_the_device(monkeypatch):
    """The one launch that forms each tensor's Adam bias terms from its step count on the device (by squaring, in
    fp64) against the same terms in Python's float64 and numpy's IEEE fp32: torch's CUDA kernel's fp32 columns
    (``lr / float(1 - beta1**step)`` rounded to fp32, ``sqrt`` of ``float(1 - beta2**step)``) within one fp32 ulp,
    the fp64 ones within the rounding that ``1 - beta**step`` amplifies."""
    import numpy as np

    pytest.importorskip("triton", reason="Triton is not installed here (CUDA builds of torch ship it)")
    from lightning_mp.kernels import cuda

    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(cuda, "_kernels", {})
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    counts = [1, 2, 3, 10, 999, 12345, 2**20 - 1]
    for beta1, beta2 in [(0.9, 0.999), (0.2, 0.9), (0.95, 0.99999)]:
        options = dict(lr=3e-4, beta1=beta1, beta2=beta2, weight_decay=0.0, eps=1e-8)
        steps = [torch.tensor(float(c), device=device) for c in counts]
        table = torch.tensor([v for s in steps for v in [0] * 7 + [s.data_ptr()]], dtype=torch.int64, device=device)
        scalars = torch.empty(4 * len(steps), dtype=torch.float64, device=device)
        cuda._kernel()
        values = cuda.CudaLeanUpdate()._options(options, device)
        cuda._kernels["bias"][(len(steps),)](table, values, scalars, scalars, COUNT=False, HAS_FOUND=False)
        got = scalars.view(-1, 4).cpu().numpy()
        for row, count in zip(got, counts):
            bias1, bias2 = 1 - beta1**count, 1 - beta2**count
            step_size = np.float32(options["lr"] / float(np.float32(bias1)))
            root = np.sqrt(np.float32(bias2))
            assert abs(np.float32(row[0]) - step_size) <= np.spacing(step_size), (beta1, count)
            assert abs(np.float32(row[1]) - root) <= np.spacing(root), (beta2, count)
            assert row[2] == pytest.approx(options["lr"] / bias1, rel=1e-12)
            assert row[3] == pytest.approx(bias2**0.5, rel=1e-11)


@pytest.mark.parametrize("flag", [None, 0.0, 1.0])
def test_the_bias_kernel_counts_steps_as_torchs_two_foreach_ops_and_forms_the_terms_from_the_new_count(
    monkeypatch, flag
):
    """COUNT: each step count becomes ``(step + 1) - found`` (torch's ``_foreach_add_`` then ``_foreach_sub_``, in
    fp32, the C kernel's lean_step) and the terms are those of ``step + 1``, the count the update runs with."""
    pytest.importorskip("triton", reason="Triton is not installed here (CUDA builds of torch ship it)")
    from lightning_mp.kernels import cuda

    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(cuda, "_kernels", {})
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    options = cuda.CudaLeanUpdate()._options(dict(lr=1e-3, beta1=0.9, beta2=0.999), device)
    cuda._kernel()

    def terms(counts, count, found):
        steps = [torch.tensor(c, device=device) for c in counts]
        table = torch.tensor([v for s in steps for v in [0] * 7 + [s.data_ptr()]], dtype=torch.int64, device=device)
        scalars = torch.empty(4 * len(steps), dtype=torch.float64, device=device)
        flag = found if found is not None else scalars
        cuda._kernels["bias"][(len(steps),)](table, options, scalars, flag, COUNT=count, HAS_FOUND=found is not None)
        return steps, scalars

    counts = [0.0, 4.0, 2.0**24 - 1]
    found = torch.tensor(flag, device=device) if flag is not None else None
    steps, counted = terms(counts, True, found)
    expected = [torch.tensor(c, device=device) for c in counts]
    torch._foreach_add_(expected, 1)
    _, direct = terms([e.item() for e in expected], False, None)  # the terms of the advanced counts
    if found is not None:
        torch._foreach_sub_(expected, [found] * len(expected))
    assert all(torch.equal(s, e) for s, e in zip(steps, expected))
    assert torch.equal(counted, direct)


def test_the_cuda_kernels_store_keeps_every_class_of_fp32_pattern(monkeypatch):
    """Contract (a) on the Triton path: an update that changes nothing (SGD, lr 0, zero gradients) writes every
    finite value, signed zero, subnormal and infinity back bit for bit, and a NaN as a NaN (quieted), through the
    kernel's own split (compiled on a GPU, interpreted elsewhere)."""
    pytest.importorskip("triton", reason="Triton is not installed here (CUDA builds of torch ship it)")
    from lightning_mp.kernels import cuda

    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(cuda, "_kernels", {})
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (6000,), generator=generator, dtype=torch.int64).to(torch.int32)
    special = torch.tensor([0, -(2**31), 1, 0x007FFFFF, 0x7F7FFFFF, 0x7F800000, -8388608, 0x7FC00000, 0x7F800001],
                           dtype=torch.int64).to(torch.int32)  # fmt: skip
    values = torch.cat([bits, special]).view(torch.float32)
    high, low = (t.to(device) for t in split_fp32(values))
    grad = torch.zeros(values.numel(), dtype=torch.bfloat16, device=device)
    options = dict(kind=native.SGD, grad_fp32=False, maximize=False, lr=0.0, weight_decay=0.0, momentum=0.0,
                   dampening=0.0, nesterov=False, first_step=False, clamped=False, clamp=-1.0)  # fmt: skip
    row = [high.data_ptr(), low.data_ptr(), grad.data_ptr(), 0, 0, 0, values.numel()]
    cuda.CudaLeanUpdate().run(0, [row], None, options, None, None, device)
    out = join_fp32(high.cpu(), low.cpu())
    nan = values.isnan()
    assert torch.equal(out[~nan].view(torch.int32), values[~nan].view(torch.int32))
    assert out[nan].isnan().all()
