"""Algorithms that write the weights during fit, against Lightning's built-in ``bf16-mixed`` (an fp32 model).

    python benchmarks/training_writes.py [--steps 24]

For each algorithm of ``tests/test_training_writes.py`` (WGAN weight clipping, a max-norm constraint, SAM in manual
optimization) and each master mode, the largest absolute difference of the weights after ``--steps`` steps from the
built-in running the same code, with the writes made as an fp32 model's code makes them and inside ``exact_weights``;
and whether a ``ModelWriteWarning`` was given. Prints a markdown table (record it in RESULTS.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import test_training_writes as cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    cases.STEPS = args.steps
    print("| algorithm | master_weights | as written: max abs diff | warned | inside exact_weights | warned |")
    print("|---|---|---:|---|---:|---|")
    for algorithm in ("clip", "max_norm", "sam"):
        builtin, _ = cases._train(algorithm, exact=False, mode=None)
        for mode in (True, "remainder"):
            row = []
            for exact in (False, True):
                try:
                    weights, said = cases._train(algorithm, exact=exact, mode=mode)
                    row += [f"{(weights - builtin).abs().max().item():.2e}", "yes" if said else "no"]
                except Exception as error:  # what was raised is the result
                    row += [f"raises {type(error).__name__}", "-"]
            print(f"| {algorithm} | {mode!r} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
