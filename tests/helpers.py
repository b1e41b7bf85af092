"""Small models, data and probes shared by the tests."""

from __future__ import annotations

import contextlib
import gc
import io
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

# Tensor methods that make the host wait for the device
HOST_SYNCS = {
    torch.Tensor.item,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.nonzero,
    torch.is_nonzero,
}


class HostSyncCounter(TorchFunctionMode):
    """Counts calls that force a device->host synchronisation."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_SYNCS:
            self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


class AtenOps(TorchDispatchMode):
    """Records, in order, the aten ops dispatched inside (what a step issues: ``benchmarks/host_work.py``'s unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class MatmulDtypes(TorchDispatchMode):
    """Records the input dtypes of every matmul-like aten op that runs."""

    MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"}

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.MATMULS:
            self.dtypes.update(a.dtype for a in args if isinstance(a, torch.Tensor))
        return func(*args, **(kwargs or {}))


def regression_loader(n: int = 64, batch_size: int = 8, seed: int = 0) -> DataLoader:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen)
    y = (x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(n, 1, generator=gen)).float()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


class TinyRegressor(L.LightningModule):
    """Linear -> Tanh -> Linear with MSE loss; hooks to inject inf gradients and record what the step saw."""

    def __init__(
        self,
        lr: float = 0.05,
        optimizer: str = "sgd",
        scheduler: Optional[str] = None,
        inject_inf_at: Sequence[int] = (),
        inject_param: str = "net.0.weight",
        return_none_at: Sequence[int] = (),
        fused: bool = False,
        record_grad_norms: bool = True,
        gamma: float = 0.5,
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.lr = lr
        self.optimizer_name = optimizer
        self.scheduler = scheduler
        self.inject_inf_at = set(inject_inf_at)
        self.inject_param = inject_param
        self.return_none_at = set(return_none_at)
        self.fused = fused
        self.record_grad_norms = record_grad_norms
        self.gamma = gamma
        self.grad_norms_seen: list[float] = []  # in on_before_optimizer_step
        self.lrs: list[float] = []
        self.example_input_array = torch.zeros(2, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Optional[torch.Tensor]:
        if self.trainer.global_step in self.return_none_at:
            return None
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def on_after_backward(self) -> None:
        if self.trainer.global_step in self.inject_inf_at:
            param = self.get_parameter(self.inject_param)
            param.grad[0, 0] = float("inf")

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad.float() for p in self.parameters() if p.grad is not None]
        if not self.record_grad_norms or not grads:
            return
        self.grad_norms_seen.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    def on_train_batch_end(self, *args: Any) -> None:
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        elif self.optimizer_name == "adam":
            opt = torch.optim.Adam(self.parameters(), lr=self.lr, fused=self.fused)
        elif self.optimizer_name == "rmsprop":  # with lean masters: the generic path (not torch's fused kernels)
            opt = torch.optim.RMSprop(self.parameters(), lr=self.lr, momentum=0.9, centered=True)
        elif self.optimizer_name == "lbfgs":
            opt = torch.optim.LBFGS(self.parameters(), lr=self.lr)
        else:
            raise ValueError(self.optimizer_name)
        if self.scheduler is None:
            return opt
        interval = self.scheduler
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=self.gamma)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": interval}}


def make_trainer(plugins: Any = None, accelerator: str = "cpu", **kwargs: Any) -> L.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator=accelerator,
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    defaults.update(kwargs)
    if plugins is not None:  # one plugin, or a list of them
        defaults["plugins"] = plugins if isinstance(plugins, list) else [plugins]
    return L.Trainer(**defaults)


def params_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


@contextlib.contextmanager
def seeded(seed: int = 0) -> Iterator[None]:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        yield


class DigitsMLP(L.LightningModule):
    """A user's own LightningModule (not one of the samples), for naming by class_path in the CLI."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return nn.functional.cross_entropy(self.net(images).float(), labels)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def fabric_trained_net(plugin: Any) -> tuple[Any, Any]:
    """A small net set up by a one-device CPU Fabric that carries ``plugin``, trained three AdamW steps: ``(fabric,
    the wrapped net)``."""
    torch.manual_seed(0)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = fabric.setup_module(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(net.parameters(), lr=0.02))
    for x in torch.randn(3, 8, 4):
        fabric.backward(net(x).float().square().mean())
        optimizer.step()
        optimizer.zero_grad()
    return fabric, net


def getting_started_block(marker: str) -> str:
    """The one Python block of docs/getting-started.md that contains ``marker``, dedented from its list item: what a
    project test runs as written (the block is marked ``docs-test: skip`` where the project is not installed)."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "getting-started.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", page, flags=re.S) if marker in b]
    assert len(blocks) == 1, f"{len(blocks)} blocks of docs/getting-started.md contain {marker!r}"
    return "\n".join(line[4:] if line.startswith("    ") else line for line in blocks[0].splitlines())


_GENERIC_8BIT: dict[str, type] = {}


def generic_adamw8bit(params: Any, **kwargs: Any) -> torch.optim.Optimizer:
    """torchao's ``AdamW8bit`` through the lean masters' *generic* path, on purpose: a subclass of it (the one-pass
    8-bit step, ``master/lean/eightbit.py``, takes the exact class only, as the table of optimizers does), for tests
    of the generic path that use torchao's block-quantized state."""
    if "class" not in _GENERIC_8BIT:
        from torchao.optim import AdamW8bit

        _GENERIC_8BIT["class"] = type("SubclassedAdamW8bit", (AdamW8bit,), {"__module__": __name__})
    return _GENERIC_8BIT["class"](params, **kwargs)


def live_cpu_bytes() -> int:
    """Bytes of every plain CPU tensor storage the garbage collector reaches, each storage once, after a collection
    (tensor subclasses such as torchao's 8-bit states are skipped: their inner codes and scales are plain tensors,
    counted themselves)."""
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if type(obj) not in (torch.Tensor, nn.Parameter):
            continue
        storage = obj.untyped_storage()
        if storage.device.type == "cpu" and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


#: how many of a module's subprocesses run at once: the suite's machine has 2 cores, and such a process spends most of
#: its seconds importing torch and Lightning on one core, so two overlap without slowing each other much
SUBPROCESSES_AT_ONCE = 2


@contextlib.contextmanager
def started_together(jobs: dict[str, Callable[[], Any]]) -> Iterator[dict[str, Future]]:
    """Each job (a function that runs a subprocess and returns what it did) started in a thread,
    ``SUBPROCESSES_AT_ONCE`` at a time in the given order; yields their futures by name, for a module fixture: each
    test waits for its own job only, and ``.result()`` raises that job's error in that test alone. Waits for every job
    on the way out. A job reads ``os.environ`` and the working folder when it starts: pass its ``env`` and ``cwd``."""
    with ThreadPoolExecutor(max_workers=SUBPROCESSES_AT_ONCE) as pool:
        yield {name: pool.submit(job) for name, job in jobs.items()}


def chosen_tests(request: Any) -> list[Any]:
    """The tests of the module of ``request`` (a module fixture's) that this session runs: all of them, or those a
    node id or ``-k`` picked, so that a fixture starts the subprocesses of those alone."""
    return [item for item in request.session.items if item.module is request.module]


def _test_name(item: Any) -> Optional[str]:
    return item.originalname


@contextlib.contextmanager
def started_per_test(
    request: Any,
    tmp_path_factory: Any,
    jobs: dict[str, Callable[[Path], Any]],
    key: Callable[[Any], Optional[str]] = _test_name,
) -> Iterator[dict[str, tuple[Future, Path]]]:
    """For a module fixture: the job of each test of the module this session runs (``jobs``: a name -> a function of
    a fresh folder that runs its subprocess there; ``key``: a test item -> the name of its job, by default the test's
    name, or ``None``), started together (:func:`started_together`); yields ``{name: (its future, its folder)}``
    (read with :func:`finished` where the names are the tests')."""
    chosen = list(dict.fromkeys(name for item in chosen_tests(request) if (name := key(item)) in jobs))
    folders = {name: tmp_path_factory.mktemp("job") for name in chosen}
    with started_together({name: lambda name=name: jobs[name](folders[name]) for name in chosen}) as futures:
        yield {name: (futures[name], folders[name]) for name in chosen}


def finished(started: dict[str, tuple[Future, Path]], request: Any) -> tuple[Any, Path]:
    """The calling test's job's result (its error raised here) and its folder."""
    future, folder = started[request.node.originalname]
    return future.result(), folder


def saved_copy(value: Any) -> Any:
    """A deep copy through a checkpoint's round trip (``torch.save`` and ``torch.load``): what ``deepcopy`` gives for
    plain tensors, and a copy of torchao's 8-bit state too (which has no ``clone``, so no ``deepcopy``)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)
