"""2-rank Fabric DDP checks of ``optimizer_in_backward=True`` (run by tests/test_in_backward_fabric_ddp.py).

    python tests/distributed/fabric_in_backward_checks.py OUT

A Fabric loop under ``strategy="ddp"`` with lean masters and AdamW, 4 steps: the updates in backward (``ours``, set
up three ways: ``fabric.setup(model, optimizer)``; ``setup_module`` then ``setup_optimizers``; ``setup_module``, a
forward, then ``setup_optimizers``) and the normal lean step (``reference``); then both with a NaN loss on rank 1
only at step ``NAN_AT``. Each rank saves, per run, the fp32 weights as ``model.state_dict()`` gives them (what
``fabric.save`` writes), the optimizer state, the gradients left after each step, whether each backward changed the
weights, DDP's communication hooks and the scaler's skipped steps to OUT/rank<r>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

from lightning_mp import MixedPrecisionPlugin
from tests.distributed.common import finish, loader, save

NAN_AT = 2  # the step whose loss is NaN on rank 1 only
STEPS = 4


def run(in_backward: bool, setup: str = "joint", nan_on_rank1: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 1))
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", optimizer_in_backward=in_backward)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[plugin])
    fabric.launch()
    data = loader(4, fabric.global_rank, 2)  # 4 steps of 4 samples per rank
    if setup == "joint":
        model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1))
    else:
        model = fabric.setup_module(net)
        if setup == "forward_first":  # the module connects at this forward, without an optimizer
            with torch.no_grad():
                model(next(iter(data))[0])
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    hooks = [getattr(hook, "__name__", repr(hook)) for hook, _ in getattr(model._forward_module, "_comm_hooks", [])]
    grads, updated = [], []
    for step, (x, y) in enumerate(data):
        loss = nn.functional.mse_loss(model(x).float(), y)
        if nan_on_rank1 and fabric.global_rank == 1 and step == NAN_AT:
            loss = loss * float("nan")
        before = net[3].weight.detach().clone()
        fabric.backward(loss)
        updated.append(not torch.equal(before, net[3].weight))
        optimizer.step()
        optimizer.zero_grad()
        grads.append([p.grad is None for p in net.parameters()])
    return {
        "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer_state": optimizer.state_dict()["state"],
        "steps": len(grads),
        "grads_after_step": grads,
        "updated_in_backward": updated,
        "comm_hooks": hooks,
        "skipped_steps": plugin.scaler.skipped_steps,
    }


def main() -> None:
    out = Path(sys.argv[1])
    results = {
        "ours": run(True),
        "ours_module_then_optimizer": run(True, "separate"),
        "ours_forward_before_optimizer": run(True, "forward_first"),
        "reference": run(False),
        "ours_nan": run(True, nan_on_rank1=True),
        "reference_nan": run(False, nan_on_rank1=True),
    }
    save(results, out, torch.distributed.get_rank())
    finish()


if __name__ == "__main__":
    main()
