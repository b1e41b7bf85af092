"""Lean master weights on a third-party decoder (HF ``LlamaForCausalLM``): memory at rest, peak heap, step time.

    python benchmarks/decoder.py                          # small Llama (7.4M params), 2 rounds, CPU
    python benchmarks/decoder.py --size issue --record    # the issue's 44.9M-parameter shape; append to HISTORY.md
    python benchmarks/decoder.py --device cuda --size gpu --batch 8 --seq 512 --steps 12   # hidden 2048, on a GPU

Modes, each a fresh process per round, the rounds alternating the modes (so machine noise hits them alike):

- ``builtin-bf16-fused``: Lightning ``precision="bf16-mixed"`` (fp32 model + autocast), ``AdamW(fused=True)``: the
  built-in as a careful user runs it (the reference of the table's ratios);
- ``builtin-bf16``: the same with ``torch.optim.AdamW``'s default implementation;
- ``builtin-bf16-true``: Lightning ``precision="bf16-true"`` (bf16 model, bf16 AdamW state: lossy);
  ``builtin-bf16-true-fused``: the same with ``AdamW(fused=True)``;
- ``ours+masters``: ``MixedPrecisionPlugin("bf16-mixed", master_weights=True)`` (bf16 model + flat fp32 masters);
- ``ours+remainder``: ``master_weights="remainder"`` (bf16 model + 16-bit remainders), AdamW;
- ``ours+remainder+compile``: the same with ``{"kind": "remainder", "compile": True}``;
- ``ours+remainder+8bit``: lean masters with torchao ``AdamW8bit``;
- ``ours+remainder+inbackward``: lean masters, AdamW, ``optimizer_in_backward=True`` (each parameter updated inside
  backward, its gradient freed);
- ``ours+remainder+8bit+inbackward``: lean masters, torchao ``AdamW8bit``, ``optimizer_in_backward=True``;
- ``builtin+8bit``: Lightning ``bf16-mixed`` with torchao ``AdamW8bit``.

Measured: *at rest*, the bytes of every live tensor storage after a step (walking ``gc.get_objects()``,
storages counted once; parameters, gradients, masters, remainders, optimizer state, anything else alive) per
parameter; *peak heap*, glibc ``mallinfo2()`` bytes in use (``uordblks + hblkhd``, not RSS) polled every 0.5 ms from
after the imports, before the model is built, to the end of fit, minus the value then, per parameter (and until
the first training batch starts: *setup*, the model built and converted, the optimizers made); *step*, the median
time of the steps after the first two (``on_train_batch_start`` to ``on_train_batch_end``), median over rounds; on
the CPU the steps are timed in a second fresh process per mode and round, without the heap poller (its
``mallinfo2`` calls take glibc's arena locks while autograd allocates and frees: measured 2026-11-26 on a 2-core
AVX512-BF16 CPU, the poller made LitGPT's small model's lean step 1.3x slower, and the step inside backward 1.6x). On
CUDA the peak is ``torch.cuda.max_memory_allocated`` over the one before the model is built, and at rest counts CUDA
storages.

``--interleaved``: step times only, every mode in *one* process, their steps alternating (the order rotating each
step), each mode on its own copy of the same model through Lightning Fabric with the same plugin settings (Fabric
here, because two Trainers' loops cannot take turns): a process-wide slowdown hits every mode alike. On a shared
virtual machine the same mode's step varies between fresh processes by more than the differences between modes
(2026-11-28, 2-core AMD EPYC: 10.3 against 15.0 ms for the same backward in two processes), so a ratio of modes
taken across processes needs many rounds, and this one does not. ``torch.compile`` modes are not offered there.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import QUIET_TRAINER, report, run_worker

SIZES = {
    "small": dict(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=8192,
    ),
    "issue": dict(
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=32000,
    ),
    "gpu": dict(  # the GPU table's: hidden 2048, 4 layers (about 0.3B parameters, a third of them the optimizer's)
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
    ),
}
MODES = [
    "builtin-bf16-fused",
    "builtin-bf16",
    "builtin-bf16-true",
    "builtin-bf16-true-fused",
    "ours+masters",
    "ours+remainder",
    "ours+remainder+compile",
    "ours+remainder+8bit",
    "builtin+8bit",
    "ours+remainder+inbackward",
    "ours+remainder+8bit+inbackward",
]


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


class HeapPeak:
    """Polls glibc's bytes in use from a thread; ``peak - start`` once stopped."""

    def __init__(self, every_s: float = 0.0005) -> None:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        self._read = lambda: (lambda m: m.uordblks + m.hblkhd)(libc.mallinfo2())
        self.start = self.peak = self._read()
        self._every, self._stop = every_s, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._read())
            time.sleep(self._every)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak - self.start


def live_tensor_bytes(device: str = "cpu") -> int:
    """Bytes of every live plain tensor storage on ``device`` (each storage once)."""
    seen, total = set(), 0
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor) or type(obj) not in (torch.Tensor, torch.nn.Parameter):
            continue  # tensor subclasses (torchao's 8-bit states) hold plain tensors, counted themselves
        try:
            storage = obj.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        if storage.data_ptr() not in seen and storage.device.type == device:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _worker(args: argparse.Namespace) -> dict:
    import lightning as L
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_mp import MixedPrecisionPlugin

    if "8bit" in args.worker:
        import torchao.optim  # noqa: F401  (imported before the count starts, like the others)
    cuda = args.device == "cuda"
    gc.collect()
    # after the imports (their heap is not the mode's), before the model; not in the process that times the steps
    heap = HeapPeak() if not cuda and not args.time_only else None
    cuda_start = torch.cuda.memory_allocated() if cuda else 0

    def peak_cuda() -> int:
        return torch.cuda.max_memory_allocated() - cuda_start

    mode = args.worker
    eight_bit = "8bit" in mode

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            config = LlamaConfig(**SIZES[args.size], max_position_embeddings=args.seq, tie_word_embeddings=False)
            self.model = LlamaForCausalLM(config)
            self.times: list[float] = []

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss.float()

        def on_train_batch_start(self, *a):
            if cuda:
                torch.cuda.synchronize()
            if not self.times and not hasattr(self, "setup_peak"):  # setup: model built, converted, optimizers
                self.setup_peak = heap.peak - heap.start if heap is not None else peak_cuda() if cuda else 0
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, *a):
            if cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self._t0)
            if len(self.times) == args.steps:
                gc.collect()
                self.at_rest = live_tensor_bytes(args.device)

        def on_train_end(self):  # before teardown, where masters give the model its fp32 values back
            self.train_peak = heap.peak - heap.start if heap is not None else peak_cuda() if cuda else 0

        def configure_optimizers(self):
            if eight_bit:
                from torchao.optim import AdamW8bit

                return AdamW8bit(self.parameters(), lr=1e-4, weight_decay=0.01)
            # what a careful user of the built-in picks
            fused = True if mode in ("builtin-bf16-fused", "builtin-bf16-true-fused") else None
            return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.01, fused=fused)

    def trainer() -> L.Trainer:  # a fresh plugin each time
        kwargs: dict = dict(accelerator=args.device, devices=1, max_steps=args.steps, **QUIET_TRAINER)
        if mode.startswith("builtin"):
            kwargs["precision"] = "bf16-true" if mode.startswith("builtin-bf16-true") else "bf16-mixed"
        else:
            masters = {"ours+masters": True, "ours+remainder+compile": {"kind": "remainder", "compile": True}}.get(
                mode, "remainder"
            )
            in_backward = mode.endswith("inbackward")
            kwargs["plugins"] = [
                MixedPrecisionPlugin("bf16-mixed", master_weights=masters, optimizer_in_backward=in_backward)
            ]
        return L.Trainer(**kwargs)

    torch.manual_seed(0)
    ids = torch.randint(0, SIZES[args.size]["vocab_size"], (args.batch * args.steps, args.seq))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=args.batch)
    module = Module()
    params = sum(p.numel() for p in module.parameters())
    trainer().fit(module, loader)
    peak = heap.stop() if heap is not None else peak_cuda() if cuda else 0
    times = module.times
    return {
        "mode": mode,
        "params": params,
        "at_rest": module.at_rest,
        "peak": peak,
        "train_peak": module.train_peak,
        "setup_peak": module.setup_peak,
        "step_s": statistics.median(times[2:] or times),
    }


INTERLEAVED = [m for m in MODES if "compile" not in m]


def _interleaved(args: argparse.Namespace) -> dict[str, list[float]]:
    """Step times of ``args.modes`` taken in turns in this process (module doc): mode -> seconds per step."""
    import lightning as L
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_mp import MixedPrecisionPlugin

    device = args.device
    runs = {}
    for mode in args.modes:
        if mode.startswith("builtin"):
            precision = "bf16-true" if mode.startswith("builtin-bf16-true") else "bf16-mixed"
            fabric = L.Fabric(accelerator=device, devices=1, precision=precision)
        else:
            masters = True if mode == "ours+masters" else "remainder"
            in_backward = mode.endswith("inbackward")
            plugin = MixedPrecisionPlugin("bf16-mixed", master_weights=masters, optimizer_in_backward=in_backward)
            fabric = L.Fabric(accelerator=device, devices=1, plugins=[plugin])
        torch.manual_seed(0)
        config = LlamaConfig(**SIZES[args.size], max_position_embeddings=args.seq, tie_word_embeddings=False)
        model = LlamaForCausalLM(config)
        if "8bit" in mode:
            from torchao.optim import AdamW8bit

            optimizer = AdamW8bit(model.parameters(), lr=1e-4, weight_decay=0.01)
        else:
            fused = True if mode in ("builtin-bf16-fused", "builtin-bf16-true-fused") else None
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=fused)
        model, optimizer = fabric.setup(model, optimizer)
        runs[mode] = (fabric, model, optimizer, [])
    ids = torch.randint(0, SIZES[args.size]["vocab_size"], (args.batch, args.seq), device=device)
    modes = list(runs)
    for step in range(args.steps):
        for mode in modes[step % len(modes) :] + modes[: step % len(modes)]:  # the order rotates every step
            fabric, model, optimizer, times = runs[mode]
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fabric.backward(model(input_ids=ids, labels=ids).loss.float())
            optimizer.step()
            optimizer.zero_grad()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return {mode: run[3] for mode, run in runs.items()}


def main_interleaved(args: argparse.Namespace) -> None:
    skip = max(2, args.steps // 10)  # the first steps (kernel builds, allocator warm-up) are not timed
    times = _interleaved(args)
    base = statistics.median(times[args.modes[0]][skip:])
    lines = [f"| mode | median step (ms) | vs {args.modes[0]} | steps timed |", "|---|---:|---:|---:|"]
    for mode, each in times.items():
        step = statistics.median(each[skip:])
        lines.append(f"| {mode} | {step * 1e3:.2f} | {step / base:.3f}x | {len(each) - skip} |")
    title = (
        f"Step times taken in turns in one process (Fabric), HF Llama {args.size}, batch {args.batch} x {args.seq}, "
        f"{args.steps} steps each"
    )
    report(title, "\n".join(lines), args.device, args.record)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=MODES)
    parser.add_argument("--record", action="store_true")
    parser.add_argument(
        "--interleaved", action="store_true", help="step times only: the modes take turns in one process (Fabric)"
    )
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--time_only", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(_worker(args)))
        return
    if args.interleaved:
        unknown = [mode for mode in args.modes if mode not in INTERLEAVED]
        if unknown:
            parser.error(f"--interleaved takes the modes {INTERLEAVED}, not {unknown}")
        return main_interleaved(args)
    runs: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    for _ in range(args.rounds):
        for mode in args.modes:
            options = ("device", "size", "batch", "seq", "steps")
            # on the CPU the steps are timed in a second process, without the heap poller
            runs[mode].append(run_worker(__file__, mode, args, options, timed_apart=args.device == "cpu"))
            print(f"round result: {runs[mode][-1]}", flush=True)  # a run cut short keeps what it measured
    reference = next((m for m in ("builtin-bf16-fused", "builtin-bf16") if m in runs), args.modes[0])
    base = statistics.median(r["step_s"] for r in runs[reference])
    base_peak = statistics.median(r["peak"] for r in runs[reference])
    memory = "peak heap in use" if args.device == "cpu" else "peak CUDA memory allocated"
    lines = [
        f"| mode | at rest, bytes/param | {memory}, bytes/param (fit incl. teardown) | peak vs {reference} "
        "| peak until train end, bytes/param | peak of the setup, bytes/param | median step (ms) "
        f"| speed vs {reference} | steps of the rounds (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for mode, rows in runs.items():
        params = rows[0]["params"]
        rest = statistics.median(r["at_rest"] for r in rows) / params
        peak = statistics.median(r["peak"] for r in rows)
        step = statistics.median(r["step_s"] for r in rows)
        each = ", ".join(f"{r['step_s'] * 1e3:.0f}" for r in rows)
        trained = [r["train_peak"] for r in rows if "train_peak" in r]
        train_peak = f"{statistics.median(trained) / params:.1f}" if trained else "-"
        setup = [r["setup_peak"] for r in rows if "setup_peak" in r]
        setup_peak = f"{statistics.median(setup) / params:.1f}" if setup else "-"
        lines.append(
            f"| {mode} | {rest:.1f} | {peak / params:.1f} | {peak / base_peak:.2f}x | {train_peak} | {setup_peak} "
            f"| {step * 1e3:.0f} | {base / step:.2f}x | {each} |"
        )
    params = next(iter(runs.values()))[0]["params"]
    title = (
        f"Lean masters on HF Llama ({args.size}, {params / 1e6:.1f}M params), batch {args.batch} x {args.seq}, "
        f"{args.steps} steps, {args.rounds} alternating rounds"
    )
    report(title, "\n".join(lines), args.device, args.record)


if __name__ == "__main__":
    main()
