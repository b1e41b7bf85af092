"""Which of our files and functions one lean optimizer step executes: a ``sys.setprofile`` trace.

    python benchmarks/step_trace.py            # the table, printed
    python benchmarks/step_trace.py --json     # the same as JSON
    python benchmarks/step_trace.py --whole    # the whole batch, from on_train_batch_start (forward and backward too)
    python benchmarks/step_trace.py --whole --in-backward   # the same with the step inside backward

A real ``lightning.Trainer`` trains a small MLP (3 bf16 Linear layers and a LayerNorm kept fp32) with
``MixedPrecisionPlugin("bf16-mixed", master_weights="remainder")`` and ``torch.optim.AdamW`` on the CPU. On the
fourth batch (after three of warm-up: the step plans exist) a profile function records every Python call made in
``lightning_mp/`` between ``on_after_backward`` and ``on_train_batch_end``: the step after backward (the gradient
check, the clipping hooks, the weights' step, the scaler's update, the loop's bookkeeping). It prints each file with the number of
distinct functions entered and calls made, and the functions by call count. Counts, not timings: the same on any
machine with the same code (the C kernel's ctypes call counts as the Python call that makes it).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from lightning_mp import MixedPrecisionPlugin  # noqa: E402

OURS = str(ROOT / "lightning_mp")
TRACED_BATCH = 3


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.Linear(64, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)


class Trace(L.Callback):
    """Profiles the step of batch ``TRACED_BATCH``: from ``on_after_backward`` (``whole``: from
    ``on_train_batch_start``) to ``on_train_batch_end``."""

    def __init__(self, whole: bool = False) -> None:
        self.calls: Counter[tuple[str, str]] = Counter()
        self.whole = whole

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(OURS):
            path = str(Path(frame.f_code.co_filename).relative_to(ROOT))
            self.calls[(path, frame.f_code.co_qualname)] += 1

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.whole and trainer.global_step == TRACED_BATCH:
            sys.setprofile(self._profile)

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        if not self.whole and trainer.global_step == TRACED_BATCH:
            sys.setprofile(self._profile)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        sys.setprofile(None)


def trace(whole: bool = False, in_backward: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    x, y = torch.randn(64, 32), torch.randn(64, 1)
    callback = Trace(whole)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=TRACED_BATCH + 1,
        plugins=[MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", optimizer_in_backward=in_backward)],
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(), DataLoader(TensorDataset(x, y), batch_size=16))
    files: dict[str, dict[str, int]] = {}
    for (path, function), count in sorted(callback.calls.items()):
        files.setdefault(path, {})[function] = count
    return {
        "files": len(files),
        "functions": len(callback.calls),
        "calls": sum(callback.calls.values()),
        "by_file": files,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['files']} files, {result['functions']} functions, {result['calls']} calls",
        "",
        "| file | functions | calls | functions entered (calls) |",
        "|---|---|---|---|",
    ]
    for path, functions in result["by_file"].items():
        named = ", ".join(f"`{name}` ({count})" for name, count in functions.items())
        lines.append(f"| `{path}` | {len(functions)} | {sum(functions.values())} | {named} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--whole", action="store_true", help="trace the whole batch from on_train_batch_start")
    parser.add_argument("--in-backward", action="store_true", help="optimizer_in_backward=True (use with --whole)")
    args = parser.parse_args()
    result = trace(args.whole, args.in_backward)
    print(json.dumps(result, indent=1) if args.json else table(result))


if __name__ == "__main__":
    main()
