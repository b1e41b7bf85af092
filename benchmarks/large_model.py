"""The largest model a machine trains: HF Llama of 1.57B parameters, a few Trainer steps per mode, fresh process each.

    python benchmarks/large_model.py [--modes bf16-true-fused ours-8bit-inbackward] [--steps 3] [--record]

The model (hidden 2048, intermediate 5632, 32 layers, 16 heads sharing 4 key/value heads, vocab 32000, untied:
1.57B parameters; the shape measured 2026-11-27, ../shared/DESIGN.md) is built in fp32 and
trained for ``--steps`` Trainer steps of 1 x 16 tokens; the steps after the first are timed (``on_train_batch_start``
to ``on_train_batch_end``), and the process's peak resident set (``ru_maxrss``, the fp32 initialisation included) is
reported. Modes:

- ``bf16-true-fused``: Lightning ``precision="bf16-true"`` with ``AdamW(fused=True)``: bf16 weights and state (loses
  every update under half a bf16 spacing): the smallest built-in;
- ``ours-8bit-inbackward``: ``MixedPrecisionPlugin("bf16-mixed", master_weights="remainder",
  optimizer_in_backward=True)`` with torchao's ``AdamW8bit``: exact fp32 master semantics;
- ``ours-8bit``: the same with the normal step (the bf16 gradients held until the step).

Lightning's ``bf16-mixed`` with ``AdamW(fused=True)`` needs 16 bytes/param of weights, gradients and state (25 GB):
on a 23 GB machine it does not fit, and is not offered. On a CPU the step is the matmuls' and the optimizer's: read
the CPU's flags (``lscpu``) before comparing; without AVX512-BF16 or AMX torch's bf16 matmuls take a slow path.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import QUIET_TRAINER, report

MODES = ("bf16-true-fused", "ours-8bit-inbackward", "ours-8bit")
CONFIG = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=32,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=16,
    tie_word_embeddings=False,
)


def _worker(mode: str, steps: int) -> dict[str, Any]:
    import lightning as L
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_mp import MixedPrecisionPlugin

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = LlamaForCausalLM(LlamaConfig(**CONFIG))
            self.times: list[float] = []
            self._start = 0.0

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss.float()

        def on_train_batch_start(self, *args: Any) -> None:
            self._start = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            self.times.append(time.perf_counter() - self._start)

        def configure_optimizers(self) -> Any:
            if mode.startswith("ours"):
                from torchao.optim import AdamW8bit

                return AdamW8bit(self.parameters(), lr=1e-4, weight_decay=0.01)
            return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.01, fused=True)

    torch.manual_seed(0)
    module = Module()
    params = sum(p.numel() for p in module.parameters())
    if mode.startswith("ours"):
        plugin = MixedPrecisionPlugin(
            "bf16-mixed", master_weights="remainder", optimizer_in_backward=mode.endswith("inbackward")
        )
        flags: dict[str, Any] = {"plugins": [plugin]}
    else:
        flags = {"precision": "bf16-true"}
    ids = torch.randint(0, CONFIG["vocab_size"], (steps, 16), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, **QUIET_TRAINER, **flags)
    trainer.fit(module, loader)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"params": params, "times": module.times, "peak_rss": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES[:2]))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(_worker(args.worker, args.steps)), flush=True)
        return
    results = {}
    for mode in args.modes:
        command = [sys.executable, __file__, "--worker", mode, "--steps", str(args.steps)]
        done = subprocess.run(command, capture_output=True, text=True)
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(done.stdout[-2000:], done.stderr[-4000:])
            raise SystemExit(f"{mode}: the worker failed (rc {done.returncode})")
        results[mode] = json.loads(line[len("RESULT ") :])
        print(f"{mode}: {results[mode]}", flush=True)
    base = statistics.median(results[args.modes[0]]["times"][1:])
    lines = [
        f"| mode | peak RSS (GB) | step, median of steps 2+ (s) | vs {args.modes[0]} | steps (s) |",
        "|---|---:|---:|---:|---|",
    ]
    for mode, result in results.items():
        step = statistics.median(result["times"][1:])
        shown = ", ".join(f"{t:.2f}" for t in result["times"])
        lines.append(f"| {mode} | {result['peak_rss'] / 1e9:.1f} | {step:.2f} | {step / base:.2f}x | {shown} |")
    params = next(iter(results.values()))["params"]
    title = f"HF Llama {params / 1e9:.2f}B on one machine, {args.steps} Trainer steps of 1 x 16 tokens"
    report(title, "\n".join(lines), "cpu", args.record)


if __name__ == "__main__":
    main()
