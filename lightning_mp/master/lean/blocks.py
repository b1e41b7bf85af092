"""Where lean masters keep the bf16 weights and int16 remainders: flat blocks, built and released one at a time.

Each converted parameter is a bf16 view into one block (a flat bf16 buffer, with a parallel int16 buffer of
remainders); a block holds consecutive parameters up to ``BLOCK_CHUNKS`` step chunks of elements (a larger parameter
has a block of its own). Blocks, not one buffer for the whole model, so that converting an fp32 model and giving the
fp32 values back at the end never hold two copies of the model: a block is allocated, its parameters are split into
it and their fp32 storage is released, then the next block (and the reverse at restore). The transient is one block
(4 bytes x its elements), or the largest parameter's, whatever the model size.

Offsets are global: ``block number * BLOCK_STRIDE + offset in the block``. Two blocks are never contiguous, so a
chunk of the step (``lightning_mp.master.lean.chunked.plan_chunks`` joins pieces that are contiguous) stays in one block.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor, nn

from lightning_mp.kernels.bits import join_fp32_into, split_fp32_into

#: Elements per block, in chunks of the step: 4 x 2**18 on CPU (4 MiB of bf16 + int16), 4 x 2**25 on a GPU.
BLOCK_CHUNKS = 4
#: Global offset of block ``i``'s first element: ``i * BLOCK_STRIDE``.
BLOCK_STRIDE = 1 << 48


class Blocks:
    """The blocks of one :class:`~lightning_mp.master.lean.store.RemainderMasters` (see module doc).

    Args:
        chunk_size_for: the step's chunk size on a device (a block is ``BLOCK_CHUNKS`` of them).
        on_release: called before a block is forgotten, to drop whatever else views it (the step plans: a plan alive
            past a release would keep the block's storage, and at restore every block, alive).
    """

    def __init__(
        self, chunk_size_for: Callable[[torch.device], int], on_release: Callable[[], None] = lambda: None
    ) -> None:
        self.chunk_size_for = chunk_size_for
        self.on_release = on_release
        self.blocks: list[Optional[tuple[Tensor, Tensor]]] = []  # (bf16 weights, int16 remainders); None: released
        self.members: list[list[nn.Parameter]] = []  # the parameters in each block, in order
        self.layout: dict[int, tuple[torch.device, int]] = {}  # id(param) -> (device, global offset)
        self.version = 0  # counts the blocks made and released (see RemainderMasters.layout_version)

    def split_in(self, params: list[nn.Parameter]) -> None:
        """Put ``params`` (fp32, or bf16 with remainder 0) in new blocks, exactly, one chunk of a value at a time."""

        def fill(param: nn.Parameter, high: Tensor, low: Tensor) -> None:
            split_by_chunks(param.data.reshape(-1), high, low, self.chunk_size_for(high.device))

        self._pack(params, fill)

    def relocate(self) -> None:
        """Rebuild, on the parameters' device, every block whose parameters are no longer its views: Lightning
        converts the model before moving it, which moves the bf16 halves and not the remainders."""
        for index, members in enumerate(self.members):
            block = self.blocks[index]
            if block is None or all(self._is_view(param, block[0]) for param in members):
                continue
            old_low = block[1]
            where = {id(p): self.layout[id(p)][1] % BLOCK_STRIDE for p in members}

            def fill(param: nn.Parameter, high: Tensor, low: Tensor, old_low: Tensor = old_low, where=where) -> None:
                high.copy_(param.data.reshape(-1))
                low.copy_(old_low[where[id(param)] : where[id(param)] + param.numel()])

            self._pack(members, fill)
            self.release(index)

    def slices(self, start: int, end: int) -> tuple[Tensor, Tensor]:
        """Elements ``[start, end)`` (global offsets, within one block) of the bf16 weights and remainders."""
        high, low = self.blocks[start // BLOCK_STRIDE]  # type: ignore[misc]
        local = start % BLOCK_STRIDE
        return high[local : local + end - start], low[local : local + end - start]

    def release(self, index: int) -> None:
        """Forget block ``index`` (its storage goes once no parameter views it; :attr:`on_release` drops the rest)."""
        self.on_release()
        self.blocks[index] = None
        self.members[index] = []
        self.version += 1

    def _pack(self, params: list[nn.Parameter], fill: Callable[[nn.Parameter, Tensor, Tensor], None]) -> None:
        # lay params out in new blocks, in order, one block at a time: allocate it, fill each member's slices, point
        # the parameter at its bf16 slice (its former storage is released there)
        groups: list[tuple[torch.device, list[nn.Parameter], int]] = []
        for param in params:
            size = BLOCK_CHUNKS * self.chunk_size_for(param.device)
            if groups and groups[-1][0] == param.device and groups[-1][2] + param.numel() <= size:
                groups[-1] = (param.device, [*groups[-1][1], param], groups[-1][2] + param.numel())
            else:
                groups.append((param.device, [param], param.numel()))
        with torch.no_grad():
            for device, members, total in groups:
                index = len(self.blocks)
                high = torch.empty(total, dtype=torch.bfloat16, device=device)
                low = torch.empty(total, dtype=torch.int16, device=device)
                self.blocks.append((high, low))
                self.members.append(members)
                self.version += 1
                offset = 0
                for param in members:
                    end = offset + param.numel()
                    fill(param, high[offset:end], low[offset:end])
                    param.data = high[offset:end].view_as(param)
                    self.layout[id(param)] = (device, index * BLOCK_STRIDE + offset)
                    offset = end

    def _is_view(self, param: nn.Parameter, high: Tensor) -> bool:
        offset = self.layout[id(param)][1] % BLOCK_STRIDE
        return param.device == high.device and param.data_ptr() == high[offset:].data_ptr()


def split_by_chunks(value: Tensor, high: Tensor, low: Tensor, step: int) -> None:
    """:func:`~lightning_mp.kernels.bits.split_fp32_into` of a flat ``value`` (any float dtype, any device) ``step``
    elements at a time: the split's int32 temporaries are one chunk's, not the value's size."""
    for start in range(0, value.numel(), step):
        stop = min(start + step, value.numel())
        split_fp32_into(value[start:stop].to(high.device, torch.float32), high[start:stop], low[start:stop])


def join_by_chunks(high: Tensor, low: Tensor, out: Tensor, step: int) -> Tensor:
    """:func:`~lightning_mp.kernels.bits.join_fp32_into` ``step`` elements at a time (on CPU the int16 remainder is
    widened into a temporary of the size joined): returns ``out``."""
    for start in range(0, out.numel(), step):
        stop = min(start + step, out.numel())
        join_fp32_into(high[start:stop], low[start:stop], out[start:stop])
    return out
