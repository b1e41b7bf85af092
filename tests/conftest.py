"""Session-wide test setup.

``lightning`` and the standalone ``pytorch_lightning`` share ``lightning_utilities``' rank-zero module, and each points
its ``log`` at its own logger when imported: once ``pytorch_lightning`` is imported (the standalone-package and
neuralforecast tests import it at collection), every ``rank_zero_info`` of the process goes to
``pytorch_lightning.utilities.rank_zero``, whose parent does not propagate. Tests that read Lightning's messages
through the ``lightning.pytorch`` logger would then see none; each test starts with the log ``lightning`` set up.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _lightning_rank_zero_log() -> Iterator[None]:
    import lightning.pytorch  # noqa: F401  (sets the shared module up first)
    import lightning_utilities.core.rank_zero as shared

    before = shared.log
    shared.log = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    yield
    shared.log = before
