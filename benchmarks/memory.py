"""Peak memory (and step time) of a BERT-size encoder under each precision mode, one process per mode.

    python benchmarks/memory.py                                  # BERT-base size, CUDA if present, else CPU
    python benchmarks/memory.py --device cpu --size tiny --steps 2  # a quick run of the same code
    python benchmarks/memory.py --record                         # also append the table to benchmarks/HISTORY.md

Modes: fp32 (Trainer precision "32-true"); Lightning's built-in mixed precision ("16-mixed" on CUDA; on CPU
Lightning turns that into bf16, so the CPU run uses "bf16-mixed" throughout); ours with autocast only
(MixedPrecisionPlugin()); ours with fp32 master weights; ours with lean masters (bf16, master_weights="remainder":
bf16 weights + 16-bit remainders). Each mode runs in a fresh subprocess so that its
peak is its own. Peak memory is torch.cuda.max_memory_allocated on CUDA and the growth of peak RSS over the
process's RSS before the model was built on CPU. "state" counts the bytes of the tensors a step keeps between
steps (weights, masters, gradients, optimizer moments; not Adam's per-tensor step counters), by walking them.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import torch
from _report import QUIET_TRAINER, report, run_worker
from torch import nn

SIZES = {
    # BERT-base: 12 layers, hidden 768, 12 heads, FFN 3072, WordPiece vocab 30522 (~110M parameters)
    "base": dict(layers=12, hidden=768, heads=12, ffn=3072, vocab=30522),
    "tiny": dict(layers=2, hidden=64, heads=4, ffn=128, vocab=1000),
}
MODES = ["fp32", "builtin", "ours", "ours+masters", "ours+remainder"]


def build_encoder(layers: int, hidden: int, heads: int, ffn: int, vocab: int, max_len: int = 512) -> nn.Module:
    """A BERT-shaped encoder with a 2-class head (random init: memory and speed do not depend on the values)."""

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = nn.Embedding(vocab, hidden)
            self.positions = nn.Embedding(max_len, hidden)
            self.embed_norm = nn.LayerNorm(hidden)
            layer = nn.TransformerEncoderLayer(hidden, heads, ffn, dropout=0.1, activation="gelu", batch_first=True)
            self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.classifier = nn.Linear(hidden, 2)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            positions = torch.arange(ids.shape[1], device=ids.device)
            h = self.embed_norm(self.tokens(ids) + self.positions(positions))
            return self.classifier(self.layers(h)[:, 0])

    return Encoder()


def _worker(args: argparse.Namespace) -> dict:
    import lightning as L

    from lightning_mp import MixedPrecisionPlugin

    cuda = args.device == "cuda"
    half = "16-mixed" if cuda else "bf16-mixed"
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_encoder(**SIZES[args.size])
            self.step_times: list[float] = []

        def training_step(self, batch, batch_idx):
            ids, labels = batch
            return nn.functional.cross_entropy(self.model(ids).float(), labels)

        def on_train_batch_start(self, *a):
            if cuda:
                torch.cuda.synchronize()
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, *a):
            if cuda:
                torch.cuda.synchronize()
            self.step_times.append(time.perf_counter() - self._t0)
            self.state_bytes = _state_bytes(self, self.trainer)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-5, weight_decay=0.01)

    trainer_kwargs: dict = dict(accelerator=args.device, devices=1, max_steps=args.steps, **QUIET_TRAINER)
    if args.worker == "fp32":
        trainer_kwargs["precision"] = "32-true"
    elif args.worker == "builtin":
        trainer_kwargs["precision"] = half
    else:
        masters = {"ours+masters": True, "ours+remainder": "remainder"}.get(args.worker, False)
        precision = "bf16-mixed" if masters == "remainder" else half  # lean masters are bf16 only
        trainer_kwargs["plugins"] = [MixedPrecisionPlugin(precision, master_weights=masters)]
    torch.manual_seed(0)
    ids = torch.randint(0, SIZES[args.size]["vocab"], (args.batch * args.steps, args.seq))
    labels = torch.randint(0, 2, (args.batch * args.steps,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, labels), batch_size=args.batch)
    module = Module()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    L.Trainer(**trainer_kwargs).fit(module, loader)
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss
    times = module.step_times[1:] or module.step_times  # the first step warms up
    return {
        "mode": args.worker,
        "precision": "32-true" if args.worker == "fp32" else "bf16-mixed" if args.worker == "ours+remainder" else half,
        "params": sum(p.numel() for p in module.parameters()),
        "peak_bytes": peak,
        "state_bytes": module.state_bytes,
        "step_s": statistics.median(times),
    }


def _state_bytes(module, trainer) -> int:
    """Bytes of distinct tensor storages held between steps: weights, masters, grads, optimizer state."""
    seen, total = set(), 0
    tensors = [t for p in module.parameters() for t in (p, p.grad)]
    plugin = trainer.precision_plugin
    if getattr(plugin, "masters", None) is not None:
        tensors += [t for pair in plugin.masters.flat_buffers for t in pair]
    for optimizer in trainer.optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                # Adam's "step" is one scalar per tensor, not per parameter: left out
                state = optimizer.state[p]
                tensors += [p, p.grad, *[v for k, v in state.items() if torch.is_tensor(v) and k != "step"]]
    for tensor in tensors:
        if tensor is not None and tensor.untyped_storage().data_ptr() not in seen:
            seen.add(tensor.untyped_storage().data_ptr())
            total += tensor.untyped_storage().nbytes()
    return total


def _table(rows: list[dict]) -> str:
    fp32 = next((r for r in rows if r["mode"] == "fp32"), rows[0])
    lines = [
        "| mode | precision | peak memory (MiB) | vs fp32 | state kept between steps (MiB) | bytes/param | step (s) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['precision']} | {r['peak_bytes'] / 2**20:.0f} | {r['peak_bytes'] / fp32['peak_bytes']:.2f}x "
            f"| {r['state_bytes'] / 2**20:.0f} | {r['state_bytes'] / r['params']:.1f} | {r['step_s']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default="base")
    parser.add_argument("--batch", type=int, default=None, help="default: 32 on CUDA, 8 on CPU")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=None, help="default: 10 on CUDA, 3 on CPU")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=MODES)
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    parser.add_argument("--record", action="store_true", help="append the table to benchmarks/HISTORY.md")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.batch = args.batch or (32 if args.device == "cuda" else 8)
    args.steps = args.steps or (10 if args.device == "cuda" else 3)
    if args.worker:
        print("RESULT " + json.dumps(_worker(args)))
        return

    rows = []
    for mode in args.modes:
        rows.append(run_worker(__file__, mode, args, ("device", "size", "batch", "seq", "steps")))
    table = _table(rows)
    title = (
        f"Memory, {args.size} encoder ({rows[0]['params'] / 1e6:.1f}M params), batch {args.batch} x seq "
        f"{args.seq}, AdamW, {args.steps} steps"
    )
    report(title, table, args.device, args.record)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
