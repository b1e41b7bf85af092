"""Optimizer edits between steps under DDP on 2 real CPU processes (gloo): each run bitwise its reference on both
ranks (the lean step, inside backward or not, against the chunked path; ``master_weights=True`` against
``master_weights=False``), and the ranks equal. The edits and the references are tests/test_optimizer_edits.py's; the
2-rank runs are tests/distributed/optimizer_edit_checks.py (one launch for the module)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.common import load_ranks
from tests.distributed.launch import launch
from tests.distributed.optimizer_edit_checks import DDP_EDITS
from tests.optimizer_edits import difference, outcome

REFERENCE_OF = {"lean": "chunked", "in backward": "chunked", "True": "bf16-mixed"}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out: Path = tmp_path_factory.mktemp("ddp-optimizer-edits")
    launch("optimizer_edit_checks.py", str(out), timeout=400)
    return load_ranks(out)


@pytest.mark.parametrize("mode", list(REFERENCE_OF))
@pytest.mark.parametrize(("name", "optimizer"), DDP_EDITS)
def test_an_edit_under_ddp_is_followed_bitwise_on_both_ranks(ranks, name, optimizer, mode):
    for rank in ranks:
        reference = rank[(name, optimizer, REFERENCE_OF[mode])]
        result = rank[(name, optimizer, mode)]
        assert "error" not in reference, reference["error"]
        assert outcome(result, reference) == "exact", result.get("error")
    assert difference(ranks[1][(name, optimizer, mode)], ranks[0][(name, optimizer, mode)]) is None
