"""Optimizer edits between steps under DDP on 2 real CPU processes (gloo): each run bitwise its reference on both
ranks (the lean step, inside backward or not, against the chunked path; ``master_weights=True`` against
``master_weights=False``; torchao's AdamW8bit in one pass against itself with its layouts made again every step), and
the ranks equal. The edits and the references are tests/test_optimizer_edits.py's; the
2-rank runs are tests/distributed/optimizer_edit_checks.py (one launch for the module)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.common import load_ranks
from tests.distributed.launch import launch
from tests.distributed.optimizer_edit_checks import DDP_EDITS
from tests.optimizer_edits import REFERENCE, difference, eight_bit_runs, outcome

REFERENCE_OF = {"lean": "chunked", "in backward": "chunked", "True": "bf16-mixed"}
REFERENCE_OF_8BIT = {"lean": REFERENCE["adamw8bit"], "in backward": REFERENCE["adamw8bit"]}
CASES = [
    pytest.param(
        name,
        optimizer,
        mode,
        id=f"{name}-{optimizer}-{mode}",
        marks=[
            pytest.mark.skipif(
                not eight_bit_runs(), reason="torchao is not installed or the 8-bit one-pass kernel is not built"
            )
        ]
        if optimizer == "adamw8bit"
        else [],
    )
    for name, optimizer in DDP_EDITS
    for mode in (REFERENCE_OF_8BIT if optimizer == "adamw8bit" else REFERENCE_OF)
]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out: Path = tmp_path_factory.mktemp("ddp-optimizer-edits")
    launch("optimizer_edit_checks.py", str(out), timeout=400)
    return load_ranks(out)


@pytest.mark.parametrize(("name", "optimizer", "mode"), CASES)
def test_an_edit_under_ddp_is_followed_bitwise_on_both_ranks(ranks, name, optimizer, mode):
    references = REFERENCE_OF_8BIT if optimizer == "adamw8bit" else REFERENCE_OF
    for rank in ranks:
        reference = rank[(name, optimizer, references[mode])]
        result = rank[(name, optimizer, mode)]
        assert "error" not in reference, reference["error"]
        assert outcome(result, reference) == "exact", result.get("error")
    assert difference(ranks[1][(name, optimizer, mode)], ranks[0][(name, optimizer, mode)]) is None
