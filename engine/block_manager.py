"""Paged KV cache accounting: which blocks each request holds. No tensors here.

A request holding `num_tokens` tokens of KV needs ceil(num_tokens / block_size)
blocks. Block ids come from FIFO free lists: allocation takes from the front and
freeing returns a request's blocks to the back, in table order, so ids are
predictable and tests can assert them exactly.

There are two pools: the device pool the model reads, and a host pool that preempted
requests swap their blocks to. A swap returns the (source, destination) block pairs
for the runner to copy; the runner copies before the step's forward pass.

With prefix caching (`enable_caching`), a block is reference counted: requests whose
prompts start with the same full blocks hold the same block ids. A block is recorded
in the `PrefixCache` when it is allocated for tokens that fill it (they are computed in
the step being scheduled, before any later step reads them). A freed block that the
cache records is not returned to the free list but kept as evictable, least recently
freed first (a request's last block before its first, since longer prefixes are reused
less); allocation takes a free block first and evicts only when none is left.

Swapping copies: a preempted request's blocks are all copied to the host pool and then
released, so a block it shares stays on the device for the requests still holding it.
Swapping back in reuses the cached blocks that still hold its leading full blocks and
copies only the rest.

With cooperative KV placement the host pool is no swap space but the second half of
running requests' tables: engine/split_blocks.py.
"""
from __future__ import annotations

from collections import OrderedDict, deque

from fusegen.engine.prefix_cache import PrefixCache
from fusegen.engine.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 enable_caching: bool = False, cache_salt: str = ""):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block; got {num_blocks}")
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._host_free: deque[int] = deque(range(num_host_blocks))
        self._ref = [0] * num_blocks  # requests holding each device block
        # free blocks the cache still records, least recently freed first
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.cache = PrefixCache(num_blocks, block_size, cache_salt) if enable_caching else None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._host_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def max_request_blocks(self) -> int:
        """The most blocks one request can hold: what `Scheduler.check_fits` admits."""
        return self.num_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._evictable)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache hits ----------------------------------------------------------

    def computed_blocks(self, request: Request) -> list[int]:
        """The cached blocks holding the request's leading full blocks, for a request
        that holds none yet. The last token is never among them: it must run to give
        logits to sample from. None for requests that need every prompt position's
        logits (prompt_logprobs)."""
        if self.cache is None or request.block_table \
                or getattr(request.params, "prompt_logprobs", None) is not None:
            return []
        return self.cache.lookup(request.token_ids, (request.num_tokens - 1) // self.block_size)

    def _num_evictable(self, blocks: list[int]) -> int:
        """Blocks among `blocks` that taking would remove from the free count."""
        return sum(self._ref[b] == 0 for b in blocks)

    # -- allocation -----------------------------------------------------------------

    def num_new_blocks(self, request: Request, num_new_tokens: int,
                       hits: list[int] = ()) -> int:
        if hits:  # a request holding no blocks, whose computed tokens start past `hits`
            return self.blocks_for(len(hits) * self.block_size + num_new_tokens) - len(hits)
        needed = self.blocks_for(request.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(request.block_table))

    def can_allocate(self, request: Request, num_new_tokens: int, hits: list[int] = ()) -> bool:
        """Whether the request fits num_new_tokens more; `hits` (from computed_blocks,
        for a request holding no blocks) are taken first."""
        need = self.num_new_blocks(request, num_new_tokens, hits) + self._num_evictable(hits)
        return need <= self.num_free_blocks

    def allocate(self, request: Request, num_new_tokens: int, hits: list[int] = ()) -> None:
        """Grow the request's table to hold num_computed_tokens + num_new_tokens. With
        `hits`, the request first takes those cached blocks and its computed tokens
        start past them."""
        if hits:
            self._take_hits(request, hits)
        count = self.num_new_blocks(request, num_new_tokens)
        if count:
            if count > self.num_free_blocks:
                raise RuntimeError(f"request {request.request_id} needs {count} KV blocks, "
                                   f"{self.num_free_blocks} free")
            request.block_table.extend(self._take() for _ in range(count))
        if self.cache is not None:
            computed = request.num_computed_tokens
            num_full = (computed + num_new_tokens) // self.block_size
            # blocks full before this step were recorded when their last tokens ran
            if count or num_full > computed // self.block_size:
                self.cache.register(request.block_table, request.token_ids, num_full)

    def _take_hits(self, request: Request, hits: list[int]) -> None:
        self._hold(hits)
        request.block_table = list(hits)
        request.num_computed_tokens = len(hits) * self.block_size

    def _hold(self, blocks: list[int]) -> None:
        """One more holder for each of these cached blocks."""
        for block in blocks:
            if self._ref[block] == 0:
                del self._evictable[block]
            self._ref[block] += 1

    def _take(self) -> int:
        """A free block: the oldest never-cached one, else the least recently freed
        cached one (evicted from the cache)."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
        if self.cache is not None:
            self.cache.forget(block)
        self._ref[block] = 1
        return block

    def free(self, request: Request) -> None:
        """Release the request's blocks; a block still held by another request stays."""
        if self.cache is None:
            self._free.extend(request.block_table)
            for block in request.block_table:
                self._ref[block] = 0
            request.block_table = []
            return
        for block in reversed(request.block_table):  # the last block is evicted first
            self._ref[block] -= 1
            if self._ref[block] == 0 and self.cache.is_registered(block):
                self._evictable[block] = None
        self._free.extend(b for b in request.block_table
                          if self._ref[b] == 0 and b not in self._evictable)
        request.block_table = []

    def reset_cache(self) -> None:
        """Forget every cached block: the evictable ones become plain free blocks."""
        if self.cache is not None:
            self.cache.clear()
            self._free.extend(self._evictable)
            self._evictable.clear()

    # -- swapping -------------------------------------------------------------------

    def free_host(self, request: Request) -> None:
        self._host_free.extend(request.host_block_table)
        request.host_block_table = []

    def can_swap_out(self, request: Request) -> bool:
        return 0 < len(request.block_table) <= len(self._host_free)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Copy the request's blocks to the host pool and release them: [(device, host)]
        to copy. Its shared blocks stay on the device for the others holding them."""
        host = [self._host_free.popleft() for _ in request.block_table]
        pairs = list(zip(request.block_table, host))
        self.free(request)
        request.host_block_table = host
        return pairs

    def can_swap_in(self, request: Request, num_new_tokens: int) -> bool:
        # as if no block were cached: a hit takes at most the free block a copy would
        return self.blocks_for(request.num_computed_tokens + num_new_tokens) \
            <= self.num_free_blocks

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]]:
        """Bring a swapped request back, with room for its next tokens: [(host, device)]
        to copy. Leading full blocks still cached on the device are taken, not copied."""
        hits = self._swap_in_hits(request)
        self._hold(hits)
        host = request.host_block_table
        device = hits + [self._take() for _ in host[len(hits):]]
        pairs = list(zip(host[len(hits):], device[len(hits):]))
        self._host_free.extend(host)
        request.host_block_table = []
        request.block_table = device
        self.allocate(request, num_new_tokens)
        return pairs

    def _swap_in_hits(self, request: Request) -> list[int]:
        if self.cache is None:
            return []
        limit = min(request.num_computed_tokens // self.block_size,
                    len(request.host_block_table))
        return self.cache.lookup(request.token_ids, limit)
