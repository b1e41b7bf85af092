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

The regions are found before backward by a walk over the autograd graph from the loss (about a microsecond per node),
by the class of their node: ``CheckpointFunctionBackward``. The walk is made before every backward only while
regions have been found: once a walk finds none, the next backwards are *watched* instead of walked. A prehook on
the loss's node records the outer backward's graph task (``torch._C._current_graph_task_id()``) and queues the end of
backward; each hook compares the task it runs in with it (one call). A hook that runs in another task is inside a
nested backward, a region the walk did not see (checkpointing switched on mid-fit): its update waits for the end of
backward as above, and the walk is made again from the next backward on. That is exact for the parameters used only
inside regions; a parameter also used outside a region, whose outer part arrived (and was updated) before a region's
part, cannot be made whole any more: that backward raises (:data:`PARTIAL`) instead of updating it twice. Under DDP
and FSDP2, where regions are refused before backward, every backward is walked.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.autograd import Variable

#: The autograd node classes of reentrant checkpoint regions (torch's, DeepSpeed's, Megatron's, fairscale's
#: ``CheckpointFunction``): each runs a nested backward of its recomputed region.
REGION_NODES = frozenset({"CheckpointFunctionBackward"})

#: Raised when a watched backward meets a region (module doc) after a parameter it reaches was updated from outside it.
PARTIAL = (
    "MixedPrecisionPlugin(optimizer_in_backward=True): reentrant activation checkpointing (use_reentrant=True) "
    "appeared in this backward after steps without it, and {name} is used both inside a checkpointed region and "
    "outside it: its update ran with the outer part of its gradient before the region's part arrived. From the next "
    "backward on the regions are found before backward and such updates wait. Switch checkpointing on before fit, "
    "pass use_reentrant=False, or use optimizer_in_backward=False."
)


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


#: the running backward's graph task id (torch's)
current_graph_task = torch._C._current_graph_task_id


class Regions:
    """The reentrant regions of one backward and the updates waiting for them (see the module doc).

    ``pending``: regions whose nested backward has not finished; ``waiting``: ``id(param) -> param`` in the order
    their hooks fired, updated by ``run`` at the end of the outermost backward.
    """

    def __init__(self) -> None:
        self.pending = 0
        self.waiting: dict[int, Tensor] = {}
        self._handles: list[Any] = []
        self.watching = False  # this backward is watched (no walk): each hook compares its graph task
        self._walk = True  # walk before the next backward: until a walk found no region, and after one was met
        #: the watched backward's graph task (a hook that runs in another is in a nested backward: :meth:`nested`)
        self.outer: Optional[int] = None
        self._run: Callable[[], None] = _nothing

    def arm(self, loss: Optional[Tensor], run: Callable[[], None], walk: bool = False) -> int:
        """Before a backward from ``loss``: find its regions (by a walk, or, once a walk found none and ``walk`` is
        false, by watching the hooks' graph tasks); with any, count them down as each finishes and have ``run`` called
        at the end of the backward. Returns how many regions the walk found (0 when watched)."""
        self.clear()
        root = getattr(loss, "grad_fn", None)
        if root is None:
            return 0
        if not (walk or self._walk):
            self.watching, self._run = True, run
            self._handles.append(root.register_prehook(self._enter))
            return 0
        nodes = region_nodes(root)
        if not nodes:
            self._walk = False
            return 0
        self.pending = len(nodes)
        for node in nodes:
            self._handles.append(node.register_hook(self._finished))
        # queued from inside the outermost backward (a queue_callback needs a running graph task), so that `run`
        # comes once every node of that backward, nested backwards included, has run
        self._handles.append(root.register_prehook(lambda grads: Variable._execution_engine.queue_callback(run)))
        return len(nodes)

    def _enter(self, grad_outputs: Any) -> None:
        # the first node of a watched backward: its graph task, and the end of backward queued on it
        self.outer = torch._C._current_graph_task_id()
        Variable._execution_engine.queue_callback(self._end)

    def _end(self) -> None:
        if self.waiting:
            self._run()

    def _finished(self, grad_inputs: Any, grad_outputs: Any) -> None:
        self.pending -= 1

    def nested(self) -> bool:
        """In a watched backward: whether the calling hook runs inside a nested backward (a region); the walk is made
        again from the next backward then."""
        if torch._C._current_graph_task_id() == self.outer:
            return False
        self._walk = True
        return True

    def wait(self, param: Tensor) -> bool:
        """Whether ``param``'s update waits for the end of backward (and remember it then)."""
        if self.pending > 0 or id(param) in self.waiting or (self.watching and self.nested()):
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
        self._handles, self.pending, self.waiting, self.watching, self.outer = [], 0, {}, False, None


def _nothing() -> None:
    pass
