"""The messages that name the optimizers the lean fast paths step take the list from the table
(:func:`lightning_mp.master.lean.optimizers.names`), so that each names every optimizer of it: NAdam too, which
messages written by hand left out (issue 52)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

import pytest
import torch

from lightning_mp.master.lean import optimizers


def _fsdp2_in_backward_refusal() -> str:
    """The refusal of an optimizer outside the table under FSDP2 with the step inside backward."""
    from lightning_mp.distributed import fsdp2_in_backward

    rmsprop = torch.optim.RMSprop([torch.zeros(2, requires_grad=True)])
    in_backward = SimpleNamespace(update=SimpleNamespace(generic=object()), optimizer=rmsprop)  # the generic path
    with pytest.raises(ValueError) as error:
        fsdp2_in_backward.register(in_backward, torch.device("cpu"))
    assert "torch.optim.rmsprop.RMSprop" in str(error.value)
    return str(error.value)


#: every message that names the table's optimizers -> how to get it
MESSAGES: dict[str, Callable[[], str]] = {
    "names()": optimizers.names,
    "distributed/fsdp2_in_backward.py: refusal": _fsdp2_in_backward_refusal,
}


@pytest.mark.parametrize("message", sorted(MESSAGES))
def test_the_message_names_every_optimizer_of_the_table(message):
    text = MESSAGES[message]()
    assert "torch.optim.NAdam" in text, text
    missing = [cls.__name__ for cls in optimizers.TABLE if f"torch.optim.{cls.__name__}" not in text]
    assert not missing, (missing, text)
