"""Reentrant checkpointing with the step inside backward: an update waits until its parameter's gradient is whole.

``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)`` (and ``checkpoint_sequential``, HF's
``gradient_checkpointing`` with ``use_reentrant=True``, DeepSpeed's, Megatron's and fairscale's ``CheckpointFunction``)
runs the forward of a region under ``no_grad`` and, in backward, a *nested* backward of the recomputed region. A
parameter used in two regions, or inside one and outside it, gets its gradient in parts, one per nested backward,
and its post-accumulate-grad hook fires once per part. Updating at the first part would step the optimizer twice
with partial gradients, and the recompute of a later region would read the updated weight.

The rule (exact: the normal lean step's bits): while a region of this backward has not finished its nested backward,
no update runs; each parameter whose hook fires in that time is remembered, and all of them are updated once, in
their order, at the end of the outermost backward (``queue_callback``), with the whole accumulated gradient, as the
normal step would. A parameter whose hook fires after the last region finished, and that is not already waiting, has
its whole gradient (autograd accumulates a leaf once per graph task) and is updated at once. Until a region finished,
the recompute reads the weights as they were before the step, as the normal step's backward does. The parameters
that wait keep their gradient until the end of backward (as with the normal step); non-reentrant checkpointing
(``use_reentrant=False``) runs no nested backward and keeps freeing each gradient as soon as it is final.

The regions are found before backward by one walk over the autograd graph from the loss (about a microsecond per
node, once per step), by the class of their node: ``CheckpointFunctionBackward``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import Tensor
from torch.autograd import Variable

#: The autograd node classes of reentrant checkpoint regions (torch's, DeepSpeed's, Megatron's, fairscale's
#: ``CheckpointFunction``): each runs a nested backward of its recomputed region.
REGION_NODES = frozenset({"CheckpointFunctionBackward"})


def region_nodes(root: Any) -> list[Any]:
    """The reentrant checkpoint nodes of the autograd graph below ``root`` (a ``grad_fn``), each once."""
    found, seen, stack = [], {root}, [root]
    while stack:
        node = stack.pop()
        if type(node).__name__ in REGION_NODES:
            found.append(node)
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return found


class Regions:
    """The reentrant regions of one backward and the updates waiting for them (see the module doc).

    ``pending``: regions whose nested backward has not finished; ``waiting``: ``id(param) -> param`` in the order
    their hooks fired, updated by ``run`` at the end of the outermost backward.
    """

    def __init__(self) -> None:
        self.pending = 0
        self.waiting: dict[int, Tensor] = {}
        self._handles: list[Any] = []

    def arm(self, loss: Optional[Tensor], run: Callable[[], None]) -> int:
        """Before a backward from ``loss``: find its regions; with any, count them down as each finishes and have
        ``run`` called at the end of the backward. Returns how many regions there are."""
        self.clear()
        root = getattr(loss, "grad_fn", None)
        nodes = region_nodes(root) if root is not None else []
        if not nodes:
            return 0
        self.pending = len(nodes)
        for node in nodes:
            self._handles.append(node.register_hook(self._finished))
        # queued from inside the outermost backward (a queue_callback needs a running graph task), so that `run`
        # comes once every node of that backward, nested backwards included, has run
        self._handles.append(root.register_prehook(lambda grads: Variable._execution_engine.queue_callback(run)))
        return len(nodes)

    def _finished(self, grad_inputs: Any, grad_outputs: Any) -> None:
        self.pending -= 1

    def wait(self, param: Tensor) -> bool:
        """Whether ``param``'s update waits for the end of backward (and remember it then)."""
        if self.pending > 0 or id(param) in self.waiting:
            self.waiting.setdefault(id(param), param)
            return True
        return False

    def take(self) -> list[Tensor]:
        """The waiting parameters (in the order their hooks first fired); the regions forgotten."""
        waiting = list(self.waiting.values())
        self.clear()
        return waiting

    def clear(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self.pending, self.waiting = [], 0, {}
