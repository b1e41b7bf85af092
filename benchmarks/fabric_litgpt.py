"""LitGPT's own model in a Fabric loop: bytes/param at rest, peak heap, step time and the loss after fine-tuning, for
fp32, ``bf16-true``, ``bf16-mixed``, lean masters with AdamW and with torchao's ``AdamW8bit``, each also with the step
inside backward (``optimizer_in_backward=True``).

    python benchmarks/fabric_litgpt.py                        # "small" (8.7M parameters), 60 + 100 steps, CPU
    python benchmarks/fabric_litgpt.py --size tiny --pretrain-steps 10 --steps 10   # a quick run of the same code
    python benchmarks/fabric_litgpt.py --record               # also append the table to benchmarks/HISTORY.md

Needs litgpt without its dependencies (``pip install psutil && pip install --no-deps litgpt==0.5.13``) and torchao.
The model, data and loop are those of examples/litgpt_finetune.py: pre-trained once in fp32 (this process), then
fine-tuned at lr 2e-5 in each mode, one fresh process per mode, from the same weights on the same batches. *At
rest*: the bytes of every live tensor storage after the last step (gradients still held), minus those alive before
the model was built, per parameter. *Peak*: glibc ``mallinfo2()`` bytes in use polled every 0.5 ms from before the
model is built to the end (benchmarks/decoder.py's ``HeapPeak``), per parameter. *Step*: the median time of the
steps after the first two, in a second process per mode without the heap poller, whose ``mallinfo2`` calls slow
the steps (benchmarks/decoder.py's docstring). *Loss*: the held-out loss of the trained values, evaluated in fp32.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
from _report import report, run_worker  # noqa: E402
from litgpt_finetune import MODES as example_modes  # noqa: E402

MODES = list(example_modes)  # examples/litgpt_finetune.py's, in its order


def _worker(args: argparse.Namespace) -> dict:
    import litgpt_finetune as example
    from decoder import HeapPeak

    if "8bit" in args.worker:
        import torchao.optim  # noqa: F401  (imported before the count starts, like the others)
    weights = torch.load(args.weights, weights_only=True)
    heap = HeapPeak() if not args.time_only else None  # the process that times the steps runs without it
    result = example.finetune(args.worker, weights, args.size, args.steps, args.lr)
    peak = heap.stop() if heap is not None else 0
    params = sum(v.numel() for k, v in result["trained"].items() if not k.endswith((".cos", ".sin")))
    loss = example.held_out_loss(result["trained"], args.size)
    return {
        "mode": args.worker,
        "params": params,
        "bytes_per_param": result["bytes_per_param"],
        "peak_per_param": peak / params,
        "step_s": statistics.median(result["step_s"][2:]),
        "loss": loss,
    }


def _table(rows: list[dict], before: float) -> str:
    mixed = next((r["loss"] for r in rows if r["mode"] == "32-true"), None)
    lines = [
        f"held-out loss before fine-tuning: {before:.4f}; {rows[0]['params'] / 1e6:.1f}M parameters\n",
        "| mode | bytes/param at rest | peak heap per param | step (s) | loss after fine-tuning | vs fp32 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        versus = f"{100 * (r['loss'] / mixed - 1):+.3f}%" if mixed else ""
        lines.append(
            f"| {r['mode']} | {r['bytes_per_param']:.2f} | {r['peak_per_param']:.2f} | {r['step_s']:.3f} "
            f"| {r['loss']:.4f} | {versus} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--weights", default="", help=argparse.SUPPRESS)
    parser.add_argument("--time_only", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--size", choices=["tiny", "small"], default="small")
    parser.add_argument("--pretrain-steps", type=int, default=60)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=MODES)
    parser.add_argument("--record", action="store_true")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="time each mode's steps in the process that measured its memory (one process per mode, not two; the heap "
        "poller then slows the steps: for checking the script, not for figures)",
    )
    args = parser.parse_args()
    if args.worker:
        import json

        print("RESULT " + json.dumps(_worker(args)))
        return
    import litgpt_finetune as example

    weights = example.pretrained(args.size, args.pretrain_steps)
    before = example.held_out_loss(weights, args.size)
    with tempfile.TemporaryDirectory() as folder:
        args.weights = str(Path(folder) / "pretrained.pt")
        torch.save(weights, args.weights)
        options = ("weights", "size", "steps", "lr")
        rows = [run_worker(__file__, mode, args, options, timed_apart=not args.quick) for mode in args.modes]
    title = f"LitGPT GPT ({args.size}) in a Fabric loop: {args.pretrain_steps} fp32 steps, then {args.steps} at lr {args.lr}"
    report(title, _table(rows, before), "cpu", args.record)


if __name__ == "__main__":
    main()
