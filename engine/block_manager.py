"""Paged KV cache accounting: which blocks each request holds. No tensors here.

A request holding `num_tokens` tokens of KV needs ceil(num_tokens / block_size)
blocks. Block ids come from FIFO free lists: allocation takes from the front and
freeing returns a request's blocks to the back, in table order, so ids are
predictable and tests can assert them exactly.

There are two pools: the device pool the model reads, and a host pool that preempted
requests swap their blocks to. A swap returns the (source, destination) block pairs
for the runner to copy; the runner copies before the step's forward pass.
"""
from __future__ import annotations

from collections import deque

from fusegen.engine.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block; got {num_blocks}")
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._host_free: deque[int] = deque(range(num_host_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._host_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        needed = self.blocks_for(request.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(request.block_table))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.num_new_blocks(request, num_new_tokens) <= len(self._free)

    def allocate(self, request: Request, num_new_tokens: int) -> None:
        """Grow the request's table to hold num_computed_tokens + num_new_tokens."""
        count = self.num_new_blocks(request, num_new_tokens)
        if count > len(self._free):
            raise RuntimeError(f"request {request.request_id} needs {count} KV blocks, "
                               f"{len(self._free)} free")
        request.block_table.extend(self._free.popleft() for _ in range(count))

    def free(self, request: Request) -> None:
        self._free.extend(request.block_table)
        request.block_table = []

    def free_host(self, request: Request) -> None:
        self._host_free.extend(request.host_block_table)
        request.host_block_table = []

    def can_swap_out(self, request: Request) -> bool:
        return 0 < len(request.block_table) <= len(self._host_free)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to the host pool: [(device, host)] to copy."""
        host = [self._host_free.popleft() for _ in request.block_table]
        pairs = list(zip(request.block_table, host))
        self.free(request)
        request.host_block_table = host
        return pairs

    def can_swap_in(self, request: Request, num_new_tokens: int) -> bool:
        return self.blocks_for(request.num_computed_tokens + num_new_tokens) <= len(self._free)

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]]:
        """Bring a swapped request back, with room for its next tokens:
        [(host, device)] to copy."""
        device = [self._free.popleft() for _ in request.host_block_table]
        pairs = list(zip(request.host_block_table, device))
        self._host_free.extend(request.host_block_table)
        request.host_block_table = []
        request.block_table = device
        self.allocate(request, num_new_tokens)
        return pairs
