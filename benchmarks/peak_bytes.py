"""Peak live tensor bytes per precision mode, counted exactly at the dispatch level on a real ``lightning.Trainer`` fit.

    python benchmarks/peak_bytes.py                       # the small HF Llama of tests/test_memory_budget.py
    python benchmarks/peak_bytes.py --size issue --steps 3  # the 58.1M-parameter HF Llama of benchmarks/decoder.py

:class:`LiveTensorBytes` is a ``TorchDispatchMode``: every storage an aten op returns is counted when it first appears
and uncounted when it dies (a ``weakref.finalize`` on the storage, whose Python object lives exactly as long as the
storage), and the storages alive when counting starts are counted from a walk of the garbage collector. The peak is
the largest sum of live bytes after any op, taken per phase of the fit: *setup* (the model built, converted, the
optimizer made: up to the first batch), *steps* (first batch start to last batch end: forwards, backwards, updates),
*teardown* (after the last batch: the plugin gives the model back its fp32 values), and *rest* (what is alive at the
end of the last step). Figures are growth over the bytes alive at the start (the model is built inside the count).

Exact, deterministic and the same on every CPU: it counts what ops return, not what allocators keep or kernels use
inside themselves, and it needs no timing (a heap poll, as in ``benchmarks/decoder.py``, can miss a short peak and
counts allocator slack). What it does not see: memory no aten op returns (the lean step's C kernels write through
raw addresses and allocate nothing; compiled code's own buffers). Tensor subclasses' inner tensors, such as torchao's
8-bit optimizer states, are made by aten ops and counted. Cyclic garbage collection is switched
off while counting, so that tensors freed only by the collector count until the end instead of at a time that
depends on the process's history.

``tests/test_memory_budget.py`` holds each mode of the "test" model to its budget.
"""

from __future__ import annotations

import argparse
import gc
import sys
import weakref
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import QUIET_TRAINER, report  # noqa: E402
from decoder import SIZES as DECODER_SIZES  # noqa: E402

from lightning_mp import MixedPrecisionPlugin  # noqa: E402

#: HF LlamaForCausalLM shapes: "test" for tests/test_memory_budget.py (1.33M parameters: two blocks of lean masters,
#: so that a block kept alive past its release shows), "issue" as benchmarks/decoder.py --size issue (58.1M, untied
#: embeddings)
SIZES = {
    "test": dict(
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=4096,
    ),
    "issue": DECODER_SIZES["issue"],
}


#: mode -> (the Trainer's precision flag or our plugin, AdamW options, callbacks)
MODES: dict[str, tuple[Callable[[], Any], dict[str, Any], list[L.Callback]]] = {
    "built-in bf16-mixed": (lambda: "bf16-mixed", {}, []),
    "built-in bf16-mixed, fused": (lambda: "bf16-mixed", {"fused": True}, []),
    "built-in bf16-true": (lambda: "bf16-true", {}, []),
    "ours True": (lambda: MixedPrecisionPlugin("bf16-mixed", master_weights=True), {}, []),
    "ours remainder": (lambda: MixedPrecisionPlugin("bf16-mixed", master_weights="remainder"), {}, []),
    "ours remainder, in backward": (
        lambda: MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", optimizer_in_backward=True),
        {},
        [],
    ),
    # torchao's AdamW8bit in one pass (issue 54): its state's inner tensors (codes, scales, maps) are made by aten
    # ops and counted; the C kernel allocates nothing
    "ours remainder, AdamW8bit": (
        lambda: MixedPrecisionPlugin("bf16-mixed", master_weights="remainder"),
        {"torchao": True},
        [],
    ),
    "ours remainder, AdamW8bit, in backward": (
        lambda: MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", optimizer_in_backward=True),
        {"torchao": True},
        [],
    ),
    # the gradients freed right after the step (zero_grad_after_step=True); by default they are kept until
    # Lightning's zero_grad (after the next forward), as with its built-in precision
    "ours remainder, gradients freed": (
        lambda: MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", zero_grad_after_step=True),
        {},
        [],
    ),
}
PHASES = ("setup", "steps", "rest", "teardown")


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the live tensor storages on ``device``, and their peak per phase (see the module doc).

    ``phase`` names the phase the next ops belong to (:meth:`enter`); ``peaks[phase]`` is the most bytes alive after
    any op of it, ``at_peak[phase]`` the op that reached it. All figures are growth over :attr:`start`.
    """

    def __init__(self, device: str = "cpu", census: bool = False) -> None:
        super().__init__()
        self.device = device
        self.sizes: dict[int, int] = {}  # the storage's StorageImpl address -> its bytes
        self.census = census  # keep, for each storage, where it was made; and the bytes by origin at the step peak
        self.origins: dict[int, str] = {}
        self.at_step_peak: dict[str, int] = {}
        self.where = ""  # the part of a step running (forward, backward, step), for the census
        self.op = "alive at start"
        self.live = 0
        self.start = 0
        self.phase = "setup"
        self.peaks: dict[str, int] = {}
        self.at_peak: dict[str, str] = {}
        self.counting = False

    def __enter__(self) -> LiveTensorBytes:
        for obj in gc.get_objects():
            if issubclass(type(obj), torch.Tensor):  # not isinstance: no lazy module's __class__ is asked
                self.track(obj)
        self.start = self.live
        self.counting = True
        self.peaks = {self.phase: 0}
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.counting = False

    def enter(self, phase: str) -> None:
        """Count what follows in ``phase`` (its peak starts at the bytes alive now; a phase may be entered again)."""
        self.phase = phase
        self.peaks[phase] = max(self.peaks.get(phase, 0), self.live - self.start)

    def track(self, tensor: Any) -> None:
        """Count ``tensor``'s storage if it is new (or resized since it was counted)."""
        if not isinstance(tensor, torch.Tensor) or is_traceable_wrapper_subclass(tensor) or tensor.is_meta:
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without a storage (sparse, ...)
            return
        if storage.device.type != self.device:
            return
        key, size = storage._cdata, storage.nbytes()
        known = self.sizes.get(key)
        if known is None:
            self.sizes[key] = size
            weakref.finalize(storage, self._freed, key)
            if self.census:
                self.origins[key] = f"{self.phase}/{self.where}: {self.op} -> {tuple(tensor.shape)} {tensor.dtype}"
        elif known == size:
            return
        self.sizes[key] = size
        self.live += size - (known or 0)

    def _freed(self, key: int) -> None:
        self.live -= self.sizes.pop(key)
        self.origins.pop(key, None)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.counting:
            self.op = str(func)
            for value in tree_flatten(out)[0]:
                self.track(value)
            grown = self.live - self.start
            if grown > self.peaks.get(self.phase, 0):
                self.peaks[self.phase] = grown
                self.at_peak[self.phase] = f"{self.where}: {func}" if self.where else str(func)
                if self.census and self.phase == "steps":
                    self.at_step_peak = {}
                    for key, size in self.sizes.items():
                        origin = self.origins.get(key, "alive at start")
                        self.at_step_peak[origin] = self.at_step_peak.get(origin, 0) + size
        return out


class Phases(L.Callback):
    """Tells the counter where the fit is: setup until the first batch, the steps, rest at the end of the last step
    (its bytes alive then), teardown after it."""

    def __init__(self, counter: LiveTensorBytes, steps: int) -> None:
        self.counter, self.steps = counter, steps

    def on_train_batch_start(self, *args: Any) -> None:
        self.counter.enter("steps")
        self.counter.where = "forward"

    def on_before_backward(self, *args: Any) -> None:
        self.counter.where = "backward"

    def on_before_optimizer_step(self, *args: Any) -> None:
        self.counter.where = "step"

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, batch: Any, index: int) -> None:
        if index + 1 == self.steps:  # the last step: what is alive between steps, then the teardown
            self.counter.rest = self.counter.live - self.counter.start
            self.counter.enter("teardown")
        self.counter.where = "after the step"


def measure(
    mode: str, size: str = "test", steps: int = 3, batch: int = 2, seq: int = 16, census: bool = False
) -> dict[str, Any]:
    """Fit HF ``LlamaForCausalLM`` of ``size`` for ``steps`` steps (batches of ``batch`` x ``seq`` tokens, AdamW) in
    ``mode`` under :class:`LiveTensorBytes`; ``{"params", "peaks": {phase: bytes}, "at_peak": {phase: op}}``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    precision, options, callbacks = MODES[mode]
    config = LlamaConfig(**SIZES[size], max_position_embeddings=seq, tie_word_embeddings=False)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = LlamaForCausalLM(config)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss.float()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if options.get("torchao"):  # torchao's AdamW8bit (the lean masters' one-pass 8-bit step)
                from torchao.optim import AdamW8bit

                return AdamW8bit(self.parameters(), lr=1e-4, weight_decay=0.01)
            return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.01, **options)

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch * steps, seq), generator=generator)
    loader = DataLoader(TensorDataset(ids), batch_size=batch)
    counter = LiveTensorBytes(census=census)
    counter.rest = 0
    chosen = precision()
    flags = {"plugins": [chosen]} if isinstance(chosen, MixedPrecisionPlugin) else {"precision": chosen}
    collecting = gc.isenabled()
    gc.disable()
    try:
        with counter:
            torch.manual_seed(0)
            module = Module()
            params = sum(p.numel() for p in module.parameters())
            trainer = L.Trainer(
                accelerator="cpu", devices=1, max_steps=steps, callbacks=[Phases(counter, steps), *callbacks], **flags,
                **QUIET_TRAINER,
            )  # fmt: skip
            trainer.fit(module, loader)
    finally:
        if collecting:
            gc.enable()
    peaks = {**counter.peaks, "rest": counter.rest}
    result = {"mode": mode, "params": params, "peaks": peaks, "at_peak": counter.at_peak}
    if census:
        result["census"] = sorted(counter.at_step_peak.items(), key=lambda item: -item[1])
    return result


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| mode | params | "
        + " | ".join(f"{phase}: bytes (per param)" for phase in PHASES)
        + " | op at the step peak |",
        "|---|---:|" + "---:|" * len(PHASES) + "---|",
    ]
    for result in results:
        cells = " | ".join(
            f"{result['peaks'][phase]:,} ({result['peaks'][phase] / result['params']:.2f})" for phase in PHASES
        )
        lines.append(f"| {result['mode']} | {result['params']:,} | {cells} | {result['at_peak'].get('steps', '')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="test")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument(
        "--census", type=int, default=0, help="print the N largest origins of the bytes at the step peak"
    )
    parser.add_argument("--record", action="store_true", help="append the table to benchmarks/HISTORY.md")
    args = parser.parse_args()
    results = [measure(mode, args.size, args.steps, args.batch, args.seq, args.census > 0) for mode in args.modes]
    for result in results if args.census else []:
        print(f"{result['mode']}: the bytes alive at the step peak by origin (phase/part: op -> shape dtype)")
        for origin, size in result["census"][: args.census]:
            print(f"  {size / result['params']:6.3f} bytes/param  {size:>13,}  {origin}")
    title = (
        f"Peak live tensor bytes (dispatch-level count), HF Llama {args.size}, batch {args.batch} x {args.seq}, "
        f"AdamW, {args.steps} steps"
    )
    report(title, table(results), "cpu", args.record)


if __name__ == "__main__":
    main()
