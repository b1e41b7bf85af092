"""2-rank checks of optimizer edits between steps (run by tests/test_optimizer_edits_ddp.py).

    python tests/distributed/optimizer_edit_checks.py OUT

The edits of tests/optimizer_edits.py that apply with several processes (state assigned, reset, restored, loaded;
options changed; parameters reordered or moved between groups: no parameter new to the optimizer, which DDP's
buckets and the fp32 masters' broadcast would not know), under DDP: the lean step, the step inside backward (its
updates driven by DDP's communication hook), the chunked path (the lean modes' reference), ``master_weights=True``
and its reference ``master_weights=False``; under torchao's AdamW8bit, the one-pass step, inside backward or not, and
its reference (its layouts made again every step). Each rank saves, per run, what :func:`tests.optimizer_edits.fit`
returns (the error as text) to OUT/rank<r>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tests.distributed.common import finish, save
from tests.optimizer_edits import BY_NAME, REFERENCE, eight_bit_runs, fit

#: (edit, optimizer) pairs run under DDP
DDP_EDITS = [
    ("state[p][moment] = zeros", "adamw"),
    ('state[p]["step"] = tensor(1.0)', "adamw"),
    ("state[p] = {} (one layer)", "adamw"),
    ("state[p].clear() (all)", "sgd"),
    ("state[p][moment] = None", "sgd"),
    ("state restored from a deepcopy", "adamw"),
    ("optimizer.load_state_dict(saved)", "adamw"),
    ("lr changed", "adamw"),
    ('group["params"].reverse()', "sgd"),
    ("two parameters swap groups", "adamw"),
    ("state[p][moment] = zeros", "adamw8bit"),
    ("state[p] = {} (one layer)", "adamw8bit"),
    ("optimizer.load_state_dict(saved)", "adamw8bit"),
    ("lr changed", "adamw8bit"),
    ("two parameters swap groups", "adamw8bit"),
]
DDP_MODES = ("lean", "in backward", "chunked", "True", "bf16-mixed")
#: torchao's AdamW8bit in one pass: its modes and their reference (tests/optimizer_edits.py REFERENCE)
DDP_MODES_8BIT = ("lean", "in backward", REFERENCE["adamw8bit"])


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    results = {}
    eight_bit = eight_bit_runs()
    for name, optimizer in DDP_EDITS:
        if optimizer == "adamw8bit" and not eight_bit:
            continue
        for mode in DDP_MODES_8BIT if optimizer == "adamw8bit" else DDP_MODES:
            result = fit(mode, optimizer, BY_NAME[name], devices=2, strategy="ddp")
            if "error" in result:
                result["error"] = f"{type(result['error']).__name__}: {result['error']}"
            results[(name, optimizer, mode)] = result
    save(results, out, torch.distributed.get_rank())
    finish()


if __name__ == "__main__":
    main()
