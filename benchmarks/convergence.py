"""Convergence on real text: validation loss per precision mode, pre-training and fine-tuning, 3 seeds each.

    python benchmarks/convergence.py                  # the recorded run: ~15 min on 2 CPU cores (see SIZES)
    python benchmarks/convergence.py --record         # also append the table to benchmarks/HISTORY.md
    python benchmarks/convergence.py --quick          # the same code at toy sizes, 1 seed (the tests run it)

The model is the project's GPT sample (:class:`~lightning_mp.samples.models.gpt.GPT`, byte level, random init),
trained with a real ``Trainer`` in each mode:

- ``fp32`` (``precision="32-true"``), Lightning's ``bf16-mixed`` and ``bf16-true`` (bf16 weights and bf16 AdamW
  state: updates below half a bf16 spacing are lost), ours ``master_weights=True`` (bf16 model, fp32 masters),
  ours ``"remainder"`` (bf16 model + 16-bit remainders: exact fp32 masters), ``"remainder"`` with torchao's
  ``AdamW8bit``, and ``fp8`` (``MixedPrecisionPlugin("bf16-mixed", fp8="tensorwise")``; emulated on a CPU: its
  loss counts, its memory and time do not).

Two regimes, each mode and seed in both:

- *pre-train*: from scratch (the seed's init) on Shakespeare's plays (the ``shakespeare`` source of the GPT
  sample), AdamW at ``lr`` 1e-3 with warm-up and cosine decay;
- *fine-tune*: from one shared checkpoint (fp32, seed 0, pre-trained on Shakespeare for ``checkpoint_steps``),
  on the Rotten Tomatoes critic snippets (``rotten_tomatoes``: another kind of text), AdamW at a constant
  ``lr`` 2e-5. The seed sets the data order.

Validation loss (nats per byte) is evaluated in the mode itself on the same fixed held-out batches every ``every``
steps. Memory, from the pre-train run of each process: *at rest*, the bytes of every live tensor storage after the
last step (``gc.get_objects()``, storages once) less those alive before the model was built (the text), per
parameter; *peak heap*, glibc ``mallinfo2()`` bytes in use polled from a thread, from before the model is built to
the end of training. *Step*: the median step (``on_train_batch_start`` to ``on_train_batch_end``, validation
excluded) after the first five, median over seeds. One process per mode and seed, the modes alternating (mode
order within a seed, then the next seed) and ``--jobs`` processes at a time with one torch thread each, so machine
noise hits the modes alike; step times on a shared machine are indicative only.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# this checkout's lightning_mp (not another one installed in the environment), and the scripts beside this one
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]
from _report import QUIET_TRAINER, report  # noqa: E402

MODES = ["fp32", "bf16-mixed", "bf16-true", "ours+masters", "ours+remainder", "ours+remainder+8bit", "fp8"]
LABELS = {
    "fp32": "fp32",
    "bf16-mixed": "Lightning `bf16-mixed`",
    "bf16-true": "Lightning `bf16-true`",
    "ours+masters": "ours `master_weights=True`",
    "ours+remainder": 'ours `"remainder"`',
    "ours+remainder+8bit": 'ours `"remainder"` + `AdamW8bit`',
    "fp8": 'ours `fp8="tensorwise"` (emulated)',
}
SIZES = {
    "full": dict(
        n_layer=2,
        n_head=4,
        n_embd=64,
        block_size=64,
        batch=16,
        pretrain_steps=600,
        checkpoint_steps=150,
        finetune_steps=300,
        every=25,
        val_batches=16,
    ),
    "quick": dict(
        n_layer=1,
        n_head=2,
        n_embd=32,
        block_size=16,
        batch=4,
        pretrain_steps=8,
        checkpoint_steps=4,
        finetune_steps=6,
        every=4,
        val_batches=2,
    ),
}
PRETRAIN_LR, FINETUNE_LR, WARMUP = 1e-3, 2e-5, 50


def _model_class():

    from lightning_mp.samples.models.gpt import GPTLanguageModel, warmup_cosine

    class ConvergenceModel(GPTLanguageModel):
        """The GPT sample with AdamW or torchao's AdamW8bit, and a constant LR (fine-tune) or warm-up + cosine."""

        def __init__(self, eight_bit: bool, constant_lr: bool, **kwargs) -> None:
            super().__init__(**kwargs)
            self.eight_bit, self.constant_lr = eight_bit, constant_lr

        def training_step(self, batch, batch_idx):
            return self._loss(batch)

        def configure_optimizers(self):
            decay = [p for p in self.parameters() if p.dim() >= 2]
            no_decay = [p for p in self.parameters() if p.dim() < 2]
            groups = [
                {"params": decay, "weight_decay": self.hparams.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ]
            if self.eight_bit:
                from torchao.optim import AdamW8bit

                optimizer = AdamW8bit(groups, lr=self.hparams.lr, betas=(0.9, 0.95))
            else:
                optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr, betas=(0.9, 0.95))
            total, warmup = max(int(self.trainer.max_steps), 1), min(self.hparams.warmup_steps, self.trainer.max_steps)

            factor = (lambda step: 1.0) if self.constant_lr else warmup_cosine(warmup, total)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return ConvergenceModel


def _trainer_kwargs(mode: str, steps: int, device: str = "cpu") -> dict:
    from lightning_mp import MixedPrecisionPlugin

    kwargs: dict = dict(
        accelerator=device, devices=1, max_steps=steps, **QUIET_TRAINER, num_sanity_val_steps=0, limit_val_batches=0
    )
    if mode in ("fp32", "bf16-mixed", "bf16-true"):
        kwargs["precision"] = {"fp32": "32-true"}.get(mode, mode)
    elif mode == "fp8":
        kwargs["plugins"] = [MixedPrecisionPlugin("bf16-mixed", fp8="tensorwise")]
    else:
        masters = True if mode == "ours+masters" else "remainder"
        kwargs["plugins"] = [MixedPrecisionPlugin("bf16-mixed", master_weights=masters)]
    return kwargs


def _data(source: str, size: dict, seed: int):
    """The training loader and the fixed validation batches of ``source``."""
    from lightning_mp.samples.data.text import TextDataModule

    data = TextDataModule(source=source, block_size=size["block_size"], batch_size=size["batch"], seed=seed)
    data.setup("fit")
    val = []
    for batch in data.val_dataloader():
        val.append(batch)
        if len(val) == size["val_batches"]:
            break
    return data.train_dataloader(), val


def fixed_buffers() -> int:
    """Bytes of the lean step's staging buffers: a fixed size (two fp32 chunks), not per parameter, so on a model
    this small they would swamp the per-parameter figure; counted apart (0 where the step keeps none)."""
    try:
        from lightning_mp.master.lean.chunked import Staging
    except ImportError:
        return 0
    staged = [o for o in gc.get_objects() if isinstance(o, Staging)]
    return sum(t.untyped_storage().nbytes() for o in staged for pair in o._buffers.values() for t in pair)


def _train(
    mode: str, size: dict, seed: int, regime: str, out: Path, measure: bool, sources: list[str], device: str = "cpu"
) -> dict:
    """One Trainer fit; the curve of validation loss, step times and (with ``measure``) memory."""
    import lightning as L
    from decoder import HeapPeak, live_tensor_bytes

    if mode.endswith("8bit"):
        import torchao.optim  # before the count starts, as the other modes import theirs
    if mode == "fp8":
        import torchao.float8  # noqa: F401

    pretrain = regime in ("pretrain", "checkpoint")
    steps = {"pretrain": size["pretrain_steps"], "checkpoint": size["checkpoint_steps"]}.get(
        regime, size["finetune_steps"]
    )
    loader, val = _data(sources[0] if pretrain else sources[1], size, seed)
    gc.collect()
    baseline = live_tensor_bytes(device) if measure else 0
    heap = HeapPeak() if measure and device == "cpu" else None  # CUDA: torch.cuda.max_memory_allocated
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(seed if regime != "checkpoint" else 0)
    model_args = {k: size[k] for k in ("n_layer", "n_head", "n_embd", "block_size")}
    module = _model_class()(
        eight_bit=mode.endswith("8bit"),
        constant_lr=not pretrain,
        lr=PRETRAIN_LR if pretrain else FINETUNE_LR,
        warmup_steps=WARMUP if size is SIZES["full"] else 2,
        **model_args,
    )
    if not pretrain:
        module.model.load_state_dict(torch.load(out / "checkpoint.pt", weights_only=True, map_location="cpu"))
    params = sum(p.numel() for p in module.parameters())

    class Record(L.Callback):
        def __init__(self) -> None:
            self.curve: list[tuple[int, float]] = []
            self.times: list[float] = []
            self.at_rest = self.fixed = 0

        def _evaluate(self, trainer, module) -> None:
            module.eval()
            with torch.no_grad(), trainer.precision_plugin.val_step_context():
                losses = [module._loss(trainer.strategy.batch_to_device(batch)).item() for batch in val]
            module.train()
            self.curve.append((trainer.global_step, statistics.fmean(losses)))

        def on_train_start(self, trainer, module) -> None:
            self._evaluate(trainer, module)

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.times.append(time.perf_counter() - self._t0)
            if trainer.global_step % size["every"] == 0 or trainer.global_step == steps:
                self._evaluate(trainer, module)
            if measure and trainer.global_step == steps:
                gc.collect()
                self.at_rest, self.fixed = live_tensor_bytes(device) - baseline, fixed_buffers()

    record = Record()
    trainer = L.Trainer(callbacks=[record], **_trainer_kwargs(mode, steps, device))
    trainer.fit(module, train_dataloaders=loader)
    peak = heap.stop() if heap is not None else 0
    if device == "cuda" and measure:
        peak = torch.cuda.max_memory_allocated()
    if regime == "checkpoint":
        torch.save(module.model.state_dict(), out / "checkpoint.pt")
    import lightning_mp

    return {
        "lightning_mp": str(Path(lightning_mp.__file__).parent),
        "mode": mode,
        "regime": regime,
        "seed": seed,
        "params": params,
        "curve": record.curve,
        "final": record.curve[-1][1],
        "at_rest": record.at_rest,
        "fixed": record.fixed,
        "peak": peak,
        "step_s": statistics.median(record.times[5:] or record.times),
    }


def _worker(args: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(1)
    size, out = SIZES[args.size], Path(args.out)
    if args.worker == "checkpoint":
        return [_train("fp32", size, 0, "checkpoint", out, False, args.sources, args.device)]
    return [
        _train(args.worker, size, args.seed, "pretrain", out, True, args.sources, args.device),
        _train(args.worker, size, args.seed, "finetune", out, False, args.sources, args.device),
    ]


def _run(worker: str, seed: int, args: argparse.Namespace) -> list[dict]:
    import os
    import subprocess

    command = [sys.executable, __file__, "--worker", worker, "--seed", str(seed), "--size", args.size]
    command += ["--out", str(args.out), "--sources", *args.sources, "--device", args.device]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"mode {worker}, seed {seed} failed:\n{done.stderr[-4000:]}")
    rows = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert rows[0]["lightning_mp"] == str(ROOT / "lightning_mp"), rows[0]["lightning_mp"]
    print(f"{worker} seed {seed}: " + ", ".join(f"{r['regime']} {r['final']:.4f}" for r in rows), flush=True)
    return rows


def _spread(values: list[float]) -> str:
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.4f}"
    return f"{mean:.4f} ± {(max(values) - min(values)) / 2:.4f}"


def table(rows: list[dict], modes: list[str]) -> str:
    """Final validation loss (mean ± half the min-max range over seeds) per regime, memory and step per mode. At rest
    per parameter leaves out the lean step's fixed-size staging buffers, shown apart in MiB."""

    def of(mode: str, regime: str) -> list[dict]:
        return [r for r in rows if r["mode"] == mode and r["regime"] == regime]

    reference = "bf16-mixed" if of("bf16-mixed", "pretrain") else modes[0]
    ref_peak = statistics.median(r["peak"] for r in of(reference, "pretrain"))
    ref_step = statistics.median(r["step_s"] for r in of(reference, "pretrain") + of(reference, "finetune"))
    lines = [
        "| mode | pre-train: final val loss | fine-tune: final val loss | fine-tune vs fp32 | at rest, bytes/param "
        f"| + fixed buffers (MiB) | peak heap (MiB) | peak vs {reference} | step (ms) | step vs {reference} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    fp32_tune = [r["final"] for r in of("fp32", "finetune")]
    for mode in modes:
        pre, tune = of(mode, "pretrain"), of(mode, "finetune")
        finals = [r["final"] for r in tune]
        gap = f"{statistics.fmean(finals) - statistics.fmean(fp32_tune):+.4f}" if fp32_tune else "-"
        if mode == "fp8":  # emulated on a CPU: its memory and time say nothing about fp8 on a GPU
            memory = "- | - | - | - | - | -"
        else:
            rest = statistics.median((r["at_rest"] - r["fixed"]) / r["params"] for r in pre)
            fixed = statistics.median(r["fixed"] for r in pre) / 2**20
            peak = statistics.median(r["peak"] for r in pre)
            step = statistics.median(r["step_s"] for r in pre + tune)
            memory = f"{rest:.2f} | {fixed:.2f} | {peak / 2**20:.1f} | {peak / ref_peak:.2f}x | {step * 1e3:.1f} | {ref_step / step:.2f}x"
        lines.append(
            f"| {LABELS[mode]} | {_spread([r['final'] for r in pre])} | {_spread(finals)} | {gap} | {memory} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], modes: list[str], path: Path, title: str, sources: list[str]) -> None:
    """Validation loss against step, one panel per regime: the mean over seeds and the min-max band per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    names = {
        "pretrain": f"pre-train from scratch ({sources[0]}, AdamW lr {PRETRAIN_LR:g}, cosine)",
        "finetune": f"fine-tune an fp32 checkpoint ({sources[1]}, AdamW lr {FINETUNE_LR:g})",
    }
    styles = {"bf16-true": ":", "fp8": "-.", "ours+remainder": "--", "ours+remainder+8bit": "--"}
    for axis, regime in zip(axes, ("pretrain", "finetune")):
        for index, mode in enumerate(modes):
            runs = [r for r in rows if r["mode"] == mode and r["regime"] == regime]
            if not runs:
                continue
            steps = [s for s, _ in runs[0]["curve"]]
            losses = torch.tensor([[v for _, v in r["curve"]] for r in runs])
            color = f"C{index}"
            axis.plot(steps, losses.mean(0), styles.get(mode, "-"), color=color, label=LABELS[mode].replace("`", ""))
            axis.fill_between(steps, losses.min(0).values, losses.max(0).values, color=color, alpha=0.2, lw=0)
        axis.set_title(names[regime])
        axis.set_xlabel("optimizer step")
        axis.set_ylabel("validation loss (nats/byte)")
        axis.grid(alpha=0.3)
    finetune = [r for r in rows if r["regime"] == "finetune"]
    if finetune:  # the fine-tune panel's interesting range: the curves, not the first evaluation's spike
        lows = [v for r in finetune for _, v in r["curve"]]
        axes[1].set_ylim(min(lows) - 0.02, max(lows) + 0.02)
    axes[0].set_ylim(top=min(axes[0].get_ylim()[1], 3.2))  # the first steps' losses (5.5 nats) flatten the rest
    axes[0].legend(fontsize=8)
    figure.suptitle(textwrap.fill(title, 150), fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="toy sizes, 1 seed (unless --seeds): the tests")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per mode (default 3; 1 with --quick)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=MODES)
    parser.add_argument(
        "--sources",
        nargs=2,
        default=["shakespeare", "rotten_tomatoes"],
        metavar=("PRETRAIN", "FINETUNE"),
        help="the GPT sample's text sources of the two regimes (default: shakespeare rotten_tomatoes)",
    )
    parser.add_argument("--jobs", type=int, default=2, help="processes at a time (default 2, one torch thread each)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where every mode trains")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "convergence")
    parser.add_argument("--png", type=Path, default=None, help="default: docs/convergence.png (full), OUT (quick)")
    parser.add_argument("--record", action="store_true", help="append the table to benchmarks/HISTORY.md")
    parser.add_argument(
        "--replot", type=Path, default=None, help="draw the picture and table again from a run's results.json"
    )
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=[*MODES, "checkpoint"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.size = args.size or ("quick" if args.quick else "full")
    if args.worker:
        print("RESULT " + json.dumps(_worker(args)))
        return
    seeds = args.seeds or (1 if args.quick else 3)
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.png or (args.out / "convergence.png" if args.quick else ROOT / "docs" / "convergence.png")
    if args.replot:
        saved = json.loads(args.replot.read_text())
        modes = [m for m in MODES if any(r["mode"] == m for r in saved["rows"])]
        plot(saved["rows"], modes, png, saved["title"], saved.get("sources", args.sources))
        print(f"{saved['title']}\n\n{table(saved['rows'], modes)}")
        return
    start = time.perf_counter()
    _run("checkpoint", 0, args)
    jobs = [(mode, seed) for seed in range(seeds) for mode in args.modes]  # the modes alternate within each seed
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        rows = [row for rows in pool.map(lambda job: _run(*job, args), jobs) for row in rows]
    wall = time.perf_counter() - start
    size = SIZES[args.size]
    params = rows[0]["params"]
    title = (
        f"Convergence, GPT sample ({size['n_layer']} layers, width {size['n_embd']}, {params / 1e3:.0f}K params, "
        f"bytes, batch {size['batch']} x {size['block_size']}): pre-train {size['pretrain_steps']} steps, "
        f"fine-tune {size['finetune_steps']} steps from an fp32 checkpoint of {size['checkpoint_steps']} steps, "
        f"{seeds} seed(s) per mode, {wall / 60:.1f} min wall"
    )
    plot(rows, args.modes, png, title, args.sources)
    saved = {"title": title, "wall_s": wall, "sources": args.sources, "rows": rows}
    (args.out / "results.json").write_text(json.dumps(saved))
    text = table(rows, args.modes)
    (args.out / "results.md").write_text(f"{title}\n\n{text}\n")
    report(
        title,
        text + f"\n\nCurves: `{png.relative_to(ROOT) if png.is_relative_to(ROOT) else png}`",
        args.device,
        args.record,
    )


if __name__ == "__main__":
    main()
