"""Step-time overhead of the casting policy's override path on the BERT sample model.

    python benchmarks/policy_overhead.py                      # MiniLM-L6 architecture, CPU bf16
    python benchmarks/policy_overhead.py --record             # also append the table to benchmarks/HISTORY.md

Three policies, interleaved step by step so that machine noise hits all alike: ``autocast`` (the default
path: no TorchFunctionMode at all), ``passthrough`` (the mode is active but overrides an op the model never
calls, so every torch function goes through it untouched: the pure interception cost), and
``conservative`` (real overrides: softmax, layer_norm, ... in fp32; this one also changes the arithmetic).
Median step time (forward + backward) over --steps steps after one warm-up step each.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _report import report

POLICIES = {"autocast": None, "passthrough": {"fp32_ops": ["cumsum"]}, "conservative": "conservative"}


def main() -> None:
    from lightning_mp import MixedPrecisionPlugin
    from lightning_mp.samples.models import BertClassifier

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=["bf16-mixed", "16-mixed"], default="bf16-mixed")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = BertClassifier("minilm", pretrained=False, config_overrides={"hidden_dropout_prob": 0.0})
    batch = {
        "input_ids": torch.randint(1000, 2000, (args.batch, args.seq)),
        "attention_mask": torch.ones(args.batch, args.seq, dtype=torch.long),
        "labels": torch.randint(0, 2, (args.batch,)),
    }
    plugins = {
        name: MixedPrecisionPlugin(
            args.precision, scaler=None if args.precision == "bf16-mixed" else 1024.0, policy=policy
        )
        for name, policy in POLICIES.items()
    }
    times: dict[str, list[float]] = {name: [] for name in POLICIES}
    for step in range(args.steps + 1):
        for name, plugin in plugins.items():
            plugin.connect(model, [], [])
            start = time.perf_counter()
            with plugin.forward_context():
                loss = model._loss_and_predictions(batch)[0]
            loss.backward()
            model.zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - start
            plugin.teardown()
            if step > 0:
                times[name].append(elapsed)
    base = statistics.median(times["autocast"])
    lines = ["| policy | median step (s) | vs autocast |", "|---|---:|---:|"]
    for name, values in times.items():
        median = statistics.median(values)
        lines.append(f"| {name} | {median:.4f} | {100 * (median / base - 1):+.2f}% |")
    title = (
        f"Policy overhead, MiniLM-L6 architecture (random init), batch {args.batch} x seq {args.seq}, "
        f"{args.precision}, {args.steps} steps each, interleaved"
    )
    report(title, "\n".join(lines), "cpu", args.record)


if __name__ == "__main__":
    main()
