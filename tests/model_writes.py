"""Writes into a set-up model, and the fp32 values each must leave in the masters (tests/test_model_writes*.py).

A tiny model with a parameter owned by the root module (``scale``) and a child module (``net``); every write kind
of docs/master-weights.md ("Writes after setup") into either target, each returning the exact fp32 values it wrote
(what the masters must hold after a step at lr 0): the loaded fp32 values for a load, the fp32 value a replacement
or new storage carries, the model's 16-bit value for a write in place.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecisionPlugin

MODES = (True, "remainder")
TARGETS = ("root", "child")
#: loads of fp32 values: plain tensors, mmap'd, LitGPT's lazy_load, assign=True, safetensors (where installed)
LOADS = ("load", "load_mmap", "load_lazy", "load_assign") + (
    ("load_safetensors",) if importlib.util.find_spec("safetensors") else ()
)
IN_PLACE = ("init", "copy", "fill", "mul", "reset")
NEW_VALUES = ("replace", "data", "data_bf16")
KINDS = LOADS + IN_PLACE + NEW_VALUES


def build(root: nn.Module) -> None:
    """``scale`` belongs to the root, ``net.0`` / ``net.2`` to a child (an ``nn.Sequential``)."""
    root.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3))
    root.net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        build(self)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x) * self.scale


def _fp32_values(shape: Any, generator: torch.Generator) -> Tensor:
    value = torch.randn(shape, generator=generator)
    return value + value * 2.0**-12  # not representable in bf16: a rounded master shows


def write(kind: str, root: nn.Module, target: str, tmp_path: Path, seed: int = 0) -> dict[str, Tensor]:
    """Write ``kind`` into ``root`` (a :class:`Net`; the root itself or its child ``net.2``) as a user would, after
    setup. Returns ``{qualified name: the exact fp32 value the masters must now hold}``."""
    owner, prefix, name = (root, "", "scale") if target == "root" else (root.net[2], "net.2.", "weight")
    generator = torch.Generator().manual_seed(seed)
    param = getattr(owner, name)
    if kind in LOADS:
        state = {key: _fp32_values(p.shape, generator) for key, p in owner.named_parameters()}
        path = tmp_path / f"{kind}-{seed}-{os.getpid()}.pt"  # one file per process (ranks write their own)
        if kind == "load":
            owner.load_state_dict(state)
        elif kind == "load_assign":
            owner.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True)
        else:
            torch.save(state, path)
            if kind == "load_mmap":
                owner.load_state_dict(torch.load(path, mmap=True, weights_only=True))
            elif kind == "load_safetensors":
                from safetensors.torch import load_file, save_file

                save_file(state, path.with_suffix(".safetensors"))
                owner.load_state_dict(load_file(path.with_suffix(".safetensors")))
            else:  # LitGPT's own loader: NotYetLoadedTensor values (a __torch_function__ wrapper)
                from litgpt.utils import lazy_load

                owner.load_state_dict(lazy_load(path))
        return {prefix + key: value for key, value in state.items()}
    if kind in IN_PLACE:
        with torch.no_grad():
            if kind == "init":
                nn.init.uniform_(param, -0.7, 0.7, generator=generator)
            elif kind == "copy":
                param.copy_(_fp32_values(param.shape, generator))
            elif kind == "fill":
                param.fill_(0.3)
            elif kind == "mul":
                param.mul_(1.3)
            elif target == "child":
                owner.reset_parameters()
            else:
                nn.init.normal_(param, generator=generator)
        written = owner.named_parameters(recurse=False) if kind == "reset" else [(name, param)]
        return {prefix + key: InPlace(p.detach().clone()) for key, p in written}
    value = _fp32_values(param.shape, generator)
    if kind == "replace":
        setattr(owner, name, nn.Parameter(value.clone()))
    elif kind == "data":
        param.data = value.clone()
    else:
        value = value.bfloat16()
        param.data = value.clone()
    return {prefix + name: value.float()}


class InPlace:
    """What a write in place left in a parameter (at the parameter's dtype): see :func:`followed`."""

    def __init__(self, value: Tensor) -> None:
        self.value = value


def followed(mode: Any, expected: dict[str, Tensor], written: dict[str, Any]) -> dict[str, Tensor]:
    """The exact values ``written`` (what :func:`write` returned) leaves in the masters, given the values they held
    (``expected``). A write in place into a 16-bit parameter: fp32 masters (``True``) keep every element whose 16-bit
    rounding the write left as it was and take the 16-bit value elsewhere; lean masters cannot tell the elements
    apart and take the whole 16-bit value. Into an fp32 parameter (new fp32 storage): the value itself."""
    values = {}
    for key, value in written.items():
        if not isinstance(value, InPlace):
            values[key] = value
        elif value.value.dtype == torch.float32 or mode == "remainder":
            values[key] = value.value.float()
        else:
            old = expected[key]
            values[key] = torch.where(value.value == old.to(value.value.dtype), old, value.value.float())
    return values


def snapshot(root: nn.Module) -> dict[str, Tensor]:
    """The fp32 values of an fp32 model (before setup)."""
    return {key: value.detach().clone() for key, value in root.state_dict().items()}


def assert_exact(saved: dict[str, Tensor], expected: dict[str, Tensor], what: str) -> None:
    """Every entry of ``saved`` is fp32 and bitwise ``expected``'s."""
    assert set(saved) == set(expected), what
    for key, value in expected.items():
        assert saved[key].dtype == torch.float32, f"{what}: {key} saved as {saved[key].dtype}"
        diff = (saved[key].float() - value).abs().max().item()
        assert torch.equal(saved[key], value), f"{what}: {key} drifted by {diff}"


def loader(steps: int) -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(4 * steps, 4, generator=generator), torch.randn(4 * steps, 3, generator=generator))
    return DataLoader(data, batch_size=4)


def zero_lr_optimizer(params: Any) -> torch.optim.Optimizer:
    """AdamW at lr 0 (no weight decay): a step leaves every exact fp32 master as it is."""
    return torch.optim.AdamW(params, lr=0.0, weight_decay=0.0)


def plugin(mode: Any) -> MixedPrecisionPlugin:
    return MixedPrecisionPlugin("bf16-mixed", master_weights=mode)


class WritingModule(L.LightningModule):
    """A LightningModule shaped as :class:`Net` that runs ``writes``: ``(moment, kind, target)`` with moment
    ``"on_train_start"`` (its hook), ``"callback"`` (a callback's ``on_train_batch_start`` of batch 1) or
    ``"batch_end"`` (its ``on_train_batch_end`` of batch 0: between steps); the module is the root of
    :func:`build`'s layout; it saves a checkpoint in
    ``on_train_end``. ``expected`` ends as the fp32 values the checkpoint must hold."""

    def __init__(self, writes: list[tuple[str, str, str]], tmp_path: Path) -> None:
        super().__init__()
        build(self)
        self.writes = writes
        self.mode: Any = True  # the master mode it runs under (fit_with_writes sets it)
        self.tmp_path = tmp_path
        self.expected = snapshot(self)
        self.saved: dict[str, Tensor] = {}

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x) * self.scale

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def configure_optimizers(self) -> Any:
        return zero_lr_optimizer(self.parameters())

    def run_writes(self, moment: str) -> None:
        for number, (when, kind, target) in enumerate(self.writes):
            if when == moment:
                written = write(kind, self, target, self.tmp_path, seed=number)
                self.expected.update(followed(self.mode, self.expected, written))

    def on_train_start(self) -> None:
        self.run_writes("on_train_start")

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self.run_writes("batch_end")

    def on_train_end(self) -> None:
        path = self.tmp_path / "trainer.ckpt"
        self.trainer.save_checkpoint(path)
        self.saved = torch.load(path, weights_only=True)["state_dict"]


class WriteInCallback(L.Callback):
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 1:
            pl_module.run_writes("callback")


def fit_with_writes(
    mode: Any, writes: list[tuple[str, str, str]], tmp_path: Path, steps: int = 3, **trainer_kwargs: Any
) -> WritingModule:
    """A Trainer fit of :class:`WritingModule` (one device unless ``trainer_kwargs`` say otherwise); with
    ``ckpt_path``, resumed from that checkpoint (what it holds is the reference the writes update)."""
    torch.manual_seed(0)  # the same model on every rank
    module = trainer_kwargs.pop("module", None) or WritingModule(writes, tmp_path)
    module.mode = mode
    devices = trainer_kwargs.pop("devices", 1)
    ckpt_path = trainer_kwargs.pop("ckpt_path", None)
    if ckpt_path is not None:
        module.expected = dict(torch.load(ckpt_path, weights_only=True)["state_dict"])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[plugin(mode)],
        callbacks=[WriteInCallback()],
        **trainer_kwargs,
    )
    trainer.fit(module, loader(steps * devices), ckpt_path=ckpt_path)
    return module


def fabric_with_writes(mode: Any, writes: list[tuple[str, str, str]], tmp_path: Path, steps: int = 3) -> None:
    """Fabric: ``writes`` as ``(step, kind, target)``, each made before the step of that number (0: right after
    ``fabric.setup``); the fp32 weights ``fabric.save`` writes after the last step must be exactly the values
    written (steps at lr 0)."""
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin(mode)])
    model = Net()
    expected = snapshot(model)
    optimizer = zero_lr_optimizer(model.parameters())
    model, optimizer = fabric.setup(model, optimizer)
    x, y = next(iter(loader(1)))
    for step in range(steps):
        for number, (when, kind, target) in enumerate(writes):
            if when == step:
                written = write(kind, model.module, target, tmp_path, seed=number)
                expected.update(followed(mode, expected, written))
        loss = nn.functional.mse_loss(model(x).float(), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    fabric.save(tmp_path / "fabric.ckpt", {"model": model})
    saved = torch.load(tmp_path / "fabric.ckpt", weights_only=True)["model"]
    assert_exact(saved, expected, f"Fabric, master_weights={mode!r}, writes {writes}")
