"""The one-pass 8-bit Adam/AdamW update on CUDA (``kernels/cuda_adam8bit.py``, a Triton kernel) against the CPU kernel
(``kernels/lean_adam8bit.c``), which is torchao's compiled step bit for bit (tests/test_lean_adam8bit.py).

Without a GPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors, numpy's IEEE fp32
arithmetic): every weight, remainder, code, scale, fp32 moment and step count must equal the C kernel's. On a GPU the
compiled kernel is compared with torchao's own CUDA step (the last test).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mp.kernels import adam8bit
from lightning_mp.kernels.bits import split_fp32
from lightning_mp.master import RemainderMasters
from lightning_mp.master.lean import eightbit
from lightning_mp.master.lean.eightbit import Adam8bitStep
from tests.helpers import seeded

torchao_optim = pytest.importorskip("torchao.optim")

KERNEL = pytest.mark.skipif(
    adam8bit.cpu_kernel() is None, reason="the 8-bit kernels need the C kernel (no C compiler here)"
)
SHAPES = [(64, 128), (4096,), (100,), (3, 1000)]  # 8-bit state (whole blocks) for the first two, fp32 for the others
FIELDS = len(adam8bit.PIECE_FIELDS)
GRAD_FP32_AT = adam8bit.PIECE_FIELDS.index("grad_fp32")


@pytest.fixture
def interpreted(monkeypatch):
    """The Triton kernel under Triton's interpreter (where a GPU is present, its own test below runs instead)."""
    pytest.importorskip("triton", reason="Triton is not installed here (CUDA builds of torch ship it)")
    if torch.cuda.is_available():
        pytest.skip("the GPU runs the compiled kernel: test_the_compiled_kernel_equals_torchaos_cuda_step")
    from lightning_mp.kernels import cuda_adam8bit

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(cuda_adam8bit, "_kernels", {})
    return cuda_adam8bit


def _states(make, block_size: int, **options):
    """fp32 parameters, torchao's optimizer and its states for them (made by its own ``_new_buffer``, as its step
    makes them: the same every call)."""
    with seeded(3):
        params = [nn.Parameter(torch.randn(shape) * 0.1) for shape in SHAPES]
    optimizer = make(params, block_size=block_size, **options)
    states = []
    for param in params:
        states.append(dict(
            step=torch.tensor(0.0), exp_avg=optimizer._new_buffer(param.detach(), True),
            exp_avg_sq=optimizer._new_buffer(param.detach(), False),
        ))  # fmt: skip
    return params, optimizer, states


def _same(a, b) -> bool:
    """The same bits (a NaN equals a NaN of the same pattern): fp32 and bf16 tensors, or torchao's 8-bit states."""
    if hasattr(a, "codes"):
        return torch.equal(a.codes, b.codes) and _same(a.scale, b.scale)
    bits = torch.int32 if a.dtype == torch.float32 else torch.int16
    return torch.equal(a.view(bits), b.view(bits))


CASES = {
    "adamw": dict(name="AdamW8bit", betas=(0.9, 0.999), block_size=256),
    "adam, fp32 weights, large t (lerp's other form), wide blocks": dict(
        name="Adam8bit", betas=(0.3, 0.4), block_size=1024, fp32_weights=True
    ),
    "adamw, clipped by norm and value, a NaN gradient": dict(
        name="AdamW8bit", betas=(0.9, 0.99), block_size=256, clip=(0.5, 1.0), nan=True
    ),
}


@KERNEL
@pytest.mark.parametrize("case", list(CASES))
def test_the_kernel_equals_the_cpu_kernel_bit_for_bit(interpreted, case):
    """Two steps (the second from the quantized state the first wrote) of the Triton kernel and of the C kernel
    from the same torchao state, the same gradients (bf16 and fp32 mixed): weights (and remainders), codes, scales,
    fp32 moments and step counts all equal."""
    _against_the_cpu_kernel(interpreted, case)


@KERNEL
@pytest.mark.parametrize("config", ["256,1", "8192,8"])
@pytest.mark.parametrize("case", ["adamw", "adam, fp32 weights, large t (lerp's other form), wide blocks"])
def test_every_launch_shape_gives_the_cpu_kernels_bits(interpreted, monkeypatch, config, case):
    """The launch shape (``LIGHTNING_MP_TRITON_8BIT_CONFIG``: one block per program of one warp, or 32 blocks of 256
    per program of 8 warps; blocks of 1024 wider than a tile of 256) changes which program updates which blocks, never
    a bit."""
    monkeypatch.setenv(interpreted.CONFIG_VARIABLE, config)
    assert interpreted.launch_shape() == tuple(int(part) for part in config.split(","))
    _against_the_cpu_kernel(interpreted, case)


@pytest.mark.parametrize("value", ["3,4", "4096", "4096,4,1", "many,4", "131072,4", "4096,64", "128,4"])
def test_a_launch_shape_that_is_not_one_is_refused_naming_the_value(monkeypatch, value):
    from lightning_mp.kernels import cuda_adam8bit

    monkeypatch.setenv(cuda_adam8bit.CONFIG_VARIABLE, value)
    with pytest.raises(ValueError, match=rf"LIGHTNING_MP_TRITON_8BIT_CONFIG='{value}': expected TILE,WARPS"):
        cuda_adam8bit.launch_shape()


def _against_the_cpu_kernel(interpreted, case):
    spec = CASES[case]
    make = getattr(torchao_optim, spec["name"])
    options = dict(lr=1e-2, weight_decay=0.1, betas=spec["betas"])
    params, optimizer, ours = _states(make, spec["block_size"], **options)
    _, _, theirs = _states(make, spec["block_size"], **options)
    lr = optimizer.param_groups[0]["lr"]
    if spec.get("fp32_weights"):
        weights = [[(p.detach().clone(), None) for p in params] for _ in range(2)]
    else:
        weights = [[split_fp32(p.detach().reshape(-1)) for p in params]]
        weights.append([(h.clone(), low.clone()) for h, low in weights[0]])
    factor, bound = spec.get("clip", (None, None))
    grad_mul = torch.tensor([factor]) if factor is not None else None
    generator = torch.Generator().manual_seed(4)
    for step in range(2):
        grads = [torch.randn(p.numel(), generator=generator) for p in params]
        grads = [g.bfloat16() if k % 2 else g for k, g in enumerate(grads)]
        if spec.get("nan") and step == 1:
            grads[0][5] = float("nan")
        pieces = [
            adam8bit.Adam8bitPiece(h, low, g, s["exp_avg"], s["exp_avg_sq"], s["step"])
            for (h, low), g, s in zip(weights[0], grads, theirs)
        ]
        adam8bit.adam8bit_step_pieces(
            pieces, lr=lr, beta1=spec["betas"][0], beta2=spec["betas"][1], weight_decay=0.1,
            adamw=spec["name"] == "AdamW8bit", grad_mul=grad_mul, clamp=bound,
        )  # fmt: skip
        rows = []
        for (h, low), s in zip(weights[1], ours):
            rows += adam8bit.piece_row(adam8bit.Adam8bitPiece(h, low, h, s["exp_avg"], s["exp_avg_sq"], s["step"]))
        launch = interpreted.Adam8bitLaunch(rows, [s["step"] for s in ours], torch.device("cpu"))
        launch.set_grad_dtypes([g.dtype == torch.float32 for g in grads])
        launch.run(
            grads, lr=lr, beta1=spec["betas"][0], beta2=spec["betas"][1], eps=1e-8, weight_decay=0.1,
            adamw=spec["name"] == "AdamW8bit", grad_mul=grad_mul, clamp=bound,
        )  # fmt: skip
        for (h1, l1), (h2, l2) in zip(*weights):
            assert _same(h1, h2)
            assert l1 is None and l2 is None or torch.equal(l1, l2)
        for s1, s2 in zip(theirs, ours):
            assert _same(s1["exp_avg"], s2["exp_avg"]) and _same(s1["exp_avg_sq"], s2["exp_avg_sq"])
            assert float(s1["step"]) == float(s2["step"]) == step + 1
    if spec.get("nan"):
        assert ours[0]["exp_avg"].scale.isnan().any()  # the NaN's block: a NaN scale, as the CPU kernel keeps it


def _lean(make, device="cpu", **options):
    with seeded(5):  # a 128x64 weight (8-bit state), a LayerNorm and biases (fp32 state)
        model = nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.Linear(128, 8)).to(device)
    store = RemainderMasters()
    store.convert(model)
    optimizer = make(model.parameters(), **options)
    store.attach([optimizer])
    return store, model, optimizer


def _exact(store, model):
    return [store.fp32_value(p) if p.dtype == torch.bfloat16 else p.detach().clone() for p in model.parameters()]


@KERNEL
def test_the_lean_step_on_the_cuda_route_equals_the_cpu_route(interpreted, monkeypatch):
    """The plugin's 8-bit step (``Adam8bitStep``) taking the CUDA route (the kernel interpreted, on CPU tensors)
    against the same step on the CPU route: three steps (clipped by norm, then by value, then both; bf16 and fp32
    gradients), a step skipped by a found flag (nothing moves, step counts included), and a step inside backward
    whose gradient check finds a NaN in one parameter (its flag set, it and its count stay; the other parameter steps;
    ``state_dict()`` read before the step already shows the counts): the same weights, states and counts throughout."""
    options = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99))
    runs = {}
    for route in ("cpu", "cuda"):
        monkeypatch.setattr(eightbit, "kernel_for", lambda params, route=route: route)
        store, model, optimizer = _lean(torchao_optim.AdamW8bit, **options)
        step = store.updates.of(optimizer).generic
        assert type(step) is Adam8bitStep
        generator = torch.Generator().manual_seed(6)
        for index in range(5):
            for param in model.parameters():
                param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)
            if index == 1:
                RemainderMasters._widen_grad(model[2].weight.grad)  # an fp32 gradient among bf16 ones
            if index in (0, 2):
                store.clip_grad_norm_(optimizer, 1.0)
            if index in (1, 2):
                store.clip_grad_value_(optimizer, 0.01)
            found = torch.tensor(1.0 if index == 3 else 0.0)
            store.fused_step(optimizer, found)
        layout = next(iter(step.layouts.values()))
        assert (layout.launch is not None) == (route == "cuda") and (layout.rows is not None) == (route == "cpu")
        # inside backward: each parameter's gradient checked in its step; on the CUDA route the launch is masked by
        # the flag on the device and the counts advance after backward (end_params), where the flag was 0
        weight, bias = model[0].weight, model[0].bias
        for param in (weight, bias):
            param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)
        weight.grad[3, 3] = float("nan")
        slots = [torch.zeros(1), torch.zeros(1)]
        before = _exact(store, model)
        step.begin_params()
        for param, slot in zip((weight, bias), slots):
            step.run_params([param], slot, [], check=True)
        saved = optimizer.state_dict()["state"]  # read between backward and the step: the counts already settled
        assert [float(saved[k]["step"]) for k in (0, 1)] == [4.0, 5.0]
        step.end_params()
        assert [slot.item() for slot in slots] == [1.0, 0.0]
        after = _exact(store, model)
        assert _same(after[0], before[0]) and not _same(after[1], before[1])  # the weight skipped, its bias not
        assert float(optimizer.state[weight]["step"]) == 4.0 and float(optimizer.state[bias]["step"]) == 5.0
        # a backward that never reached the step (an exception in it): its counts are settled at the next begin
        bias.grad = torch.randn(bias.shape, generator=generator).to(bias.dtype)
        step.begin_params()
        step.run_params([bias], torch.zeros(1), [], check=True)
        step.begin_params()
        assert float(optimizer.state[bias]["step"]) == 6.0
        runs[route] = (_exact(store, model), [optimizer.state[p] for p in model.parameters()])
    (weights, states), (their_weights, their_states) = runs["cuda"], runs["cpu"]
    for ours, theirs in zip(weights, their_weights):
        assert _same(ours, theirs)
    for ours, theirs in zip(states, their_states):
        assert float(ours["step"]) == float(theirs["step"])  # five steps, one skipped (and one inside backward)
        assert _same(ours["exp_avg"], theirs["exp_avg"]) and _same(ours["exp_avg_sq"], theirs["exp_avg_sq"])
    assert type(states[0]["exp_avg"]).__name__ == "OptimState8bit"


def test_the_route_is_chosen_by_the_parameters_device(monkeypatch):
    """CPU parameters take the C kernel; CUDA ones the Triton kernel where Triton is installed; mixed devices, no
    compiled kernel or ``LIGHTNING_MP_NATIVE=0``: torchao's own step (``None``)."""
    from lightning_mp.kernels import cuda

    cpu = [torch.zeros(2)]
    built = adam8bit.cpu_kernel() is not None
    assert eightbit.kernel_for(cpu) == ("cpu" if built else None)
    monkeypatch.setenv("LIGHTNING_MP_NATIVE", "0")
    assert eightbit.kernel_for(cpu) is None
    monkeypatch.delenv("LIGHTNING_MP_NATIVE")
    meta = [torch.zeros(2, device="meta")]
    assert eightbit.kernel_for(meta) is None and eightbit.kernel_for(cpu + meta) is None
    if torch.cuda.is_available() and built:
        gpu = [torch.zeros(2, device="cuda")]
        assert eightbit.kernel_for(gpu) == ("cuda" if cuda.triton_available() else None)
        assert eightbit.kernel_for(cpu + gpu) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the compiled Triton kernel)")
@KERNEL
def test_the_compiled_kernel_equals_torchaos_cuda_step():
    """On a GPU: the lean step (the compiled Triton kernel) against torchao's own optimizer stepping fp32 copies on
    the GPU, the same gradients, three steps: the exact weights within 1e-6 relative of torchao's (a few fp32
    roundings: its compiled CUDA code may round an operation differently from the C kernel's order); the largest gap
    per parameter is printed, for the record of how far from torchao's own CUDA bits the kernel is."""
    options = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99))
    store, model, optimizer = _lean(torchao_optim.AdamW8bit, "cuda", **options)
    reference = [p.detach().clone().requires_grad_() for p in _exact(store, model)]
    ref_optimizer = torchao_optim.AdamW8bit(reference, **options)
    generator = torch.Generator().manual_seed(7)
    for _ in range(3):
        for param, ref in zip(model.parameters(), reference):
            grad = torch.randn(param.shape, generator=generator).to(device="cuda", dtype=param.dtype)
            param.grad, ref.grad = grad, grad.float()
        store.fused_step(optimizer, None)
        ref_optimizer.step()
    assert store.updates.of(optimizer).generic.layouts
    layout = next(iter(store.updates.of(optimizer).generic.layouts.values()))
    assert layout.launch is not None
    gaps = [(a - b.detach()).abs().max().item() for a, b in zip(_exact(store, model), reference)]
    print("largest gap per parameter to torchao's CUDA step:", gaps)
    for ours, theirs in zip(_exact(store, model), reference):
        torch.testing.assert_close(ours, theirs.detach(), rtol=1e-6, atol=1e-7)


@KERNEL
def test_a_trainer_fit_inside_backward_on_the_cuda_route_equals_the_cpu_route(interpreted, monkeypatch, tmp_path):
    """The step inside backward through Lightning's Trainer (bf16-mixed: every gradient checked, its flag handed to
    the launch on the device, the step counts advanced after backward by the hooks' ``finish``), the CUDA route
    against the CPU route: the same exact weights, states and step counts after three steps."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_mp import MixedPrecisionPlugin

    class Regressor(L.LightningModule):
        def __init__(self):
            super().__init__()
            with seeded(8):
                self.net = nn.Sequential(nn.Linear(32, 128), nn.LayerNorm(128), nn.Linear(128, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self):
            return torchao_optim.AdamW8bit(self.parameters(), lr=1e-2, weight_decay=0.1)

    with seeded(9):
        x = torch.randn(24, 32)
    runs = {}
    launches = []
    launch = interpreted.Adam8bitLaunch.run
    monkeypatch.setattr(
        interpreted.Adam8bitLaunch, "run", lambda self, *a, **k: launches.append(1) or launch(self, *a, **k)
    )
    for route in ("cpu", "cuda"):
        monkeypatch.setattr(eightbit, "kernel_for", lambda params, route=route: route)
        module = Regressor()
        plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", optimizer_in_backward=True)
        trainer = L.Trainer(
            plugins=[plugin], max_steps=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        )  # fmt: skip
        trainer.fit(module, DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8))
        optimizer = trainer.optimizers[0]
        assert len(launches) == (0 if route == "cpu" else 3 * 6)  # a launch per parameter (6) and step
        weights = [p.detach().float().clone() for p in module.parameters()]  # the exact fp32 weights after fit
        runs[route] = weights, [optimizer.state[p] for p in module.parameters()]
    for ours, theirs in zip(*(runs[r][0] for r in ("cuda", "cpu"))):
        assert _same(ours, theirs)
    for ours, theirs in zip(*(runs[r][1] for r in ("cuda", "cpu"))):
        assert float(ours["step"]) == float(theirs["step"]) == 3.0
        assert _same(ours["exp_avg"], theirs["exp_avg"]) and _same(ours["exp_avg_sq"], theirs["exp_avg_sq"])
