"""Cooperative KV placement: a request's blocks partly on the device, partly in the host
pool, attention computed where each part lies (kernels/cooperative_attention.py). No tensors.

Block ids are one space: 0..num_blocks-1 the device's blocks, num_blocks.. the host's
(host block h is id num_blocks + h). A request's table is its device blocks, then its host
blocks: block index i of a request lives on the device when i < `device_quota`, in the host
pool otherwise. The quota is the same for every request and fixed for the engine's life,
so the split point of a request depends on nothing but its length: the reduction order of
its attention (device keys, then host keys, merged) is the same in every batch, which is
what deterministic mode needs, and a prefix-cache hit at block index i lies where the
request taking it would have put it.

Both pools follow the device pool's rules (block_manager.py): FIFO free lists, and with
prefix caching, reference counts and an evictable list per pool (least recently freed
first) that allocation evicts from only when that pool has no free block. Nothing is ever
swapped: the host pool holds running requests' blocks, and a preempted request frees both
parts and is recomputed.
"""
from __future__ import annotations

from collections import OrderedDict, deque

from fusegen.engine.block_manager import BlockManager
from fusegen.engine.prefix_cache import PrefixCache
from fusegen.engine.request import Request


def make_block_manager(kv_split, num_blocks: int, block_size: int, num_host_blocks: int,
                       enable_caching: bool, cache_salt: str) -> BlockManager:
    """The engine's block manager for `kv_split` (engine/memory/kv_split.py): the host pool
    a swap space, or with cooperative placement the second half of running requests' KV."""
    if kv_split.cooperative:
        return SplitBlockManager(num_blocks, block_size, num_host_blocks,
                                 kv_split.device_quota, enable_caching, cache_salt)
    return BlockManager(num_blocks, block_size, num_host_blocks, enable_caching, cache_salt)


class SplitBlockManager(BlockManager):
    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int,
                 device_quota: int, enable_caching: bool = False, cache_salt: str = ""):
        if num_host_blocks < 1:
            raise ValueError(f"cooperative KV placement needs host KV blocks; got "
                             f"{num_host_blocks}")
        if not 1 <= device_quota <= num_blocks:
            raise ValueError(f"device_quota {device_quota} must be 1..{num_blocks} (the "
                             "device's blocks)")
        super().__init__(num_blocks, block_size, 0, enable_caching, cache_salt)
        self.num_host_blocks = num_host_blocks
        self.device_quota = device_quota
        total = num_blocks + num_host_blocks
        self._host_free = deque(range(num_blocks, total))
        self._host_evictable: OrderedDict[int, None] = OrderedDict()
        self._ref = [0] * total
        self.cache = PrefixCache(total, block_size, cache_salt) if enable_caching else None

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._host_free) + len(self._host_evictable)

    @property
    def max_request_blocks(self) -> int:
        return self.device_quota + self.num_host_blocks

    def on_host(self, block: int) -> bool:
        return block >= self.num_blocks

    def split(self, table: list[int]) -> tuple[list[int], list[int]]:
        """A table as (device block ids, host pool block ids)."""
        cut = min(self.device_quota, len(table))
        return table[:cut], [b - self.num_blocks for b in table[cut:]]

    # -- allocation -----------------------------------------------------------------

    def _new_by_place(self, request: Request, num_new_tokens: int,
                      hits: list[int] = ()) -> tuple[int, int]:
        """(device, host) blocks the request takes for num_new_tokens more."""
        have = len(hits) if hits else len(request.block_table)
        start = len(hits) * self.block_size if hits else request.num_computed_tokens
        needed = max(have, self.blocks_for(start + num_new_tokens))
        on_device = max(0, min(needed, self.device_quota) - have)
        return on_device, needed - have - on_device

    def can_allocate(self, request: Request, num_new_tokens: int, hits: list[int] = ()) -> bool:
        device, host = self._new_by_place(request, num_new_tokens, hits)
        held = [b for b in hits if self._ref[b] == 0]  # taking them removes them from free
        device += sum(not self.on_host(b) for b in held)
        host += sum(self.on_host(b) for b in held)
        return device <= self.num_free_blocks and host <= self.num_free_host_blocks

    def allocate(self, request: Request, num_new_tokens: int, hits: list[int] = ()) -> None:
        if hits:
            self._take_hits(request, hits)
        device, host = self._new_by_place(request, num_new_tokens)
        if device > self.num_free_blocks or host > self.num_free_host_blocks:
            raise RuntimeError(f"request {request.request_id} needs {device} device and "
                               f"{host} host KV blocks, {self.num_free_blocks} and "
                               f"{self.num_free_host_blocks} free")
        request.block_table.extend([self._take() for _ in range(device)]
                                   + [self._take_host() for _ in range(host)])
        if self.cache is not None:
            computed = request.num_computed_tokens
            num_full = (computed + num_new_tokens) // self.block_size
            if device + host or num_full > computed // self.block_size:
                self.cache.register(request.block_table, request.token_ids, num_full)

    def _hold(self, blocks: list[int]) -> None:
        for block in blocks:
            if self._ref[block] == 0:
                del self._pool_evictable(block)[block]
            self._ref[block] += 1

    def _pool_evictable(self, block: int) -> OrderedDict:
        return self._host_evictable if self.on_host(block) else self._evictable

    def _take_host(self) -> int:
        """A free host block: the oldest never-cached one, else the least recently freed
        cached one (evicted from the cache)."""
        if self._host_free:
            block = self._host_free.popleft()
        else:
            block, _ = self._host_evictable.popitem(last=False)
        if self.cache is not None:
            self.cache.forget(block)
        self._ref[block] = 1
        return block

    def free(self, request: Request) -> None:
        """Release the request's blocks in both pools; a block another request holds
        stays; a cached one becomes evictable in its pool, the last block first."""
        table = request.block_table
        for block in reversed(table):
            self._ref[block] -= 1
            if self._ref[block] == 0 and self.cache is not None \
                    and self.cache.is_registered(block):
                self._pool_evictable(block)[block] = None
        for block in table:
            if self._ref[block] == 0 and block not in self._pool_evictable(block):
                (self._host_free if self.on_host(block) else self._free).append(block)
        request.block_table = []

    def reset_cache(self) -> None:
        if self.cache is not None:
            self.cache.clear()
            self._free.extend(self._evictable)
            self._host_free.extend(self._host_evictable)
            self._evictable.clear()
            self._host_evictable.clear()

    # -- no swapping: the host pool holds running requests' blocks --------------------

    def can_swap_out(self, request: Request) -> bool:
        return False
