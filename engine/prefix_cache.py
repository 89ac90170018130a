"""Prefix caching: which full KV blocks hold which tokens, so that a request reuses the
blocks another request already computed. Plain Python over integers, no tensors.

A full block's key is a hash chained over the tokens, key_i = blake2b(key_{i-1} +
block i's token ids), where key_{-1} is a digest of the salt (the model, dtype and cache
layout), so a block's key names its whole prefix. The key only finds a candidate: a block
is reused when its own token ids equal the request's and its parent is the block matched
just before, checked by the parent's registration serial (serials are never reused). Two
different prefixes are therefore never confused, whatever the hash does.

Per device block id this keeps the block's key, tokens and serial while the block holds
them (from when it is full until it is taken for other tokens). A block whose content is
already registered under another block (the same prefix computed twice) borrows that
block's serial, so its successors still chain; a block after a hash collision has no
serial, and neither it nor its successors are ever registered.
"""
from __future__ import annotations

import hashlib
import itertools
from array import array

ROOT_SERIAL = 0  # the parent serial of every prompt's first block


def chain_hash(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """The key of a full block holding `tokens` after the prefix keyed `parent`."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class PrefixCache:
    def __init__(self, num_blocks: int, block_size: int, salt: str):
        self.block_size = block_size
        self._root = hashlib.blake2b(salt.encode(), digest_size=16).digest()
        self._serials = itertools.count(ROOT_SERIAL + 1)
        self._by_key: dict[bytes, int] = {}  # registered blocks: key -> block id
        # per block id, set once the block is full and its tokens computed (or scheduled)
        self._key: list[bytes | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._serial: list[int | None] = [None] * num_blocks  # None: not reusable
        self._parent: list[int | None] = [None] * num_blocks  # parent serial, registered blocks

    @property
    def num_registered(self) -> int:
        return len(self._by_key)

    def is_registered(self, block: int) -> bool:
        key = self._key[block]
        return key is not None and self._by_key.get(key) == block

    def lookup(self, token_ids: list[int], max_blocks: int) -> list[int]:
        """The registered blocks holding the first full blocks of `token_ids`, in order,
        at most `max_blocks` of them; stops at the first block not found."""
        hits, key, serial, size = [], self._root, ROOT_SERIAL, self.block_size
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * size:(i + 1) * size])
            key = chain_hash(key, tokens)
            block = self._by_key.get(key)
            if block is None or self._tokens[block] != tokens or self._parent[block] != serial:
                break
            hits.append(block)
            serial = self._serial[block]
        return hits

    def register(self, table: list[int], token_ids: list[int], num_full: int) -> None:
        """Record blocks table[:num_full], which hold full blocks of `token_ids` (computed
        by the end of this step). Blocks already recorded are skipped: they are a prefix
        of the table, so the walk starts after the last of them."""
        start = num_full
        while start > 0 and self._key[table[start - 1]] is None:
            start -= 1
        size = self.block_size
        for i in range(start, num_full):
            parent_key = self._root if i == 0 else self._key[table[i - 1]]
            parent = ROOT_SERIAL if i == 0 else self._serial[table[i - 1]]
            tokens = tuple(token_ids[i * size:(i + 1) * size])
            self._record(table[i], chain_hash(parent_key, tokens), tokens, parent)

    def _record(self, block: int, key: bytes, tokens: tuple[int, ...],
                parent: int | None) -> None:
        self._key[block], self._tokens[block] = key, tokens
        other = self._by_key.get(key)
        if parent is None:  # after a collision: the prefix has no identity to chain on
            self._serial[block] = None
        elif other is None:
            self._by_key[key] = block
            self._serial[block], self._parent[block] = next(self._serials), parent
        elif self._tokens[other] == tokens and self._parent[other] == parent:
            self._serial[block] = self._serial[other]  # the same prefix, computed twice
        else:  # a hash collision: the block stays private
            self._serial[block] = None

    def forget(self, block: int) -> None:
        """The block is taken for other tokens: drop what it held."""
        if self.is_registered(block):
            del self._by_key[self._key[block]]
        self._key[block] = self._tokens[block] = self._serial[block] = None
        self._parent[block] = None

    def clear(self) -> None:
        """Forget every block (after a failed step, whose blocks may hold partial writes)."""
        for block in range(len(self._key)):
            self.forget(block)
