"""What the ported upstream tests share: our plugin in place of Lightning's, and where gradients live.

Upstream tests read gradients from ``self.parameters()``. With ``master_weights=True`` our plugin moves each
half gradient into the fp32 master right after ``on_after_backward`` (docs/master-weights.md, "What happens, and when"), so the
optimizer, ``on_before_optimizer_step`` and clipping see them on the masters (``main_params``). The helpers
below read gradients where the optimizer reads them, so one assertion serves both modes.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from typing import Any, Callable, Optional

import lightning as L
import torch
from torch import Tensor, nn

from lightning_mp import MixedPrecisionPlugin
from tests.distributed.common import finish

MASTER_WEIGHTS = [False, True]


def trainer_with(plugin: MixedPrecisionPlugin, **kwargs: Any) -> L.Trainer:
    """A CPU ``Trainer`` running ``plugin``, quiet by default; ``kwargs`` override the defaults."""
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    defaults.update(kwargs)
    return L.Trainer(plugins=[plugin], **defaults)


def on_cpu(plugin: MixedPrecisionPlugin) -> MixedPrecisionPlugin:
    """``plugin`` connected to a CPU module, so its autocast device is the CPU on any machine (before
    ``connect`` it would pick CUDA when present)."""
    plugin.connect(nn.Linear(1, 1), [], [])
    return plugin


def plugin_of(trainer: L.Trainer) -> MixedPrecisionPlugin:
    plugin = trainer.precision_plugin
    assert isinstance(plugin, MixedPrecisionPlugin)
    return plugin


def grad_of(trainer: L.Trainer, param: Tensor) -> Optional[Tensor]:
    """The gradient the optimizer will use for model parameter ``param``: its master's with master weights."""
    masters = plugin_of(trainer).masters
    master = masters.master_of(param) if masters is not None else None
    return param.grad if master is None else master.grad


def grads_of(trainer: L.Trainer, params: Iterable[Tensor]) -> list[Optional[Tensor]]:
    return [grad_of(trainer, p) for p in params]


def pending_grads(trainer: L.Trainer, params: Iterable[Tensor]) -> list[Tensor]:
    """In ``on_after_backward``: the (still scaled) gradients the optimizer will find once this backward's half
    gradients have been added into the masters. Without master weights, simply ``p.grad``; with fp32 masters also
    where the model shows its master's gradient (a backward after the first of an accumulation added into it)."""
    out = []
    for p in params:
        accumulated = grad_of(trainer, p)
        shown = accumulated is not None and p.grad is not None and p.grad.data_ptr() == accumulated.data_ptr()
        if accumulated is p.grad or shown:
            out.append(p.grad)
        else:
            half = p.grad.float() if p.grad is not None else torch.zeros_like(accumulated)
            out.append(half if accumulated is None else accumulated + half)
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_entry(rank: int, world_size: int, port: int, fn: Callable[..., None], args: tuple) -> None:
    # Lightning sees LOCAL_RANK and treats the processes as launched from outside: it joins them, spawns none
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    fn(*args)
    finish()  # leave no gloo threads to the interpreter's shutdown (they can abort the process there)


def run_in_two_processes(fn: Callable[..., None], *args: Any) -> None:
    """Run ``fn(*args)`` in two real processes that form one gloo process group through Lightning's ``ddp``
    strategy (``devices=2``). The processes start once, so several Trainer calls can share them."""
    torch.multiprocessing.spawn(_rank_entry, args=(2, free_port(), fn, args), nprocs=2, join=True)
