"""KV block bookkeeping: a pool of fixed-size blocks, reference counts and the prefix cache.

A block of a sequence becomes shareable once it is full: it is registered under a hash of its
tokens chained with the hash of the block before it, so a later request whose prompt starts with
the same tokens finds the same blocks and skips computing them. Released blocks that carry a hash
stay cached (least recently released evicted first) until their space is needed.

The pool's memory is reserved, not touched: a block's pages become resident the first time it is
written. So blocks are handed out lowest number first, and the cache keeps at most
`retain_blocks` released blocks in memory that no request in flight needed: past that, the
least recently released cached block is reused before an untouched one. Resident KV memory is
then the most that requests in flight ever held plus that retention, not the whole pool (a
first-in first-out free list, or a cache that keeps every released block until the pool is
full, ends by touching all of it).

With a disk cache (disk_cache.py, `disk`), an evicted block is handed to it before its space is
reused, and a lookup the memory misses asks it for the block before giving up.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from probserve.engine.prefix_hash import BlockHash


class BlockStore(Protocol):
    """Where evicted blocks go and missed ones come from (disk_cache.py: DiskCache)."""

    def spill(self, block: int, h: BlockHash, tokens: tuple[int, ...]) -> None: ...

    def has(self, h: BlockHash) -> bool: ...

    def restore(self, block: int, h: BlockHash, tokens: tuple[int, ...]) -> bool: ...


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        prefix_caching: bool = True,
        retain_blocks: int | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        # released cached blocks kept beyond what requests in flight touched (None: all)
        self.retain_blocks = num_blocks if retain_blocks is None else max(0, retain_blocks)
        # block 0 is the null block: never handed out (masked attention positions read it).
        # Free blocks (no cached content) in a heap: the lowest is handed out first.
        self._free: list[int] = list(range(1, num_blocks))
        self._touched = 1  # blocks below this number have been handed out (are resident)
        self._ref = [0] * num_blocks
        self._hash_of: dict[int, BlockHash] = {}
        self._tokens_of: dict[int, tuple[int, ...]] = {}
        self._by_hash: dict[BlockHash, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.disk: BlockStore | None = None  # a second level below memory (disk_cache.py)
        # told of each block handed out (a hybrid runner drops the block's state snapshot)
        self.on_allocate: Callable[[int], None] | None = None

    def num_available(self) -> int:
        return len(self._free) + len(self._evictable)

    def num_in_use(self) -> int:
        return self.num_blocks - 1 - self.num_available()

    def num_cached(self) -> int:
        return len(self._by_hash)

    def num_touched(self) -> int:
        """Blocks ever handed out: the resident part of the pool (the null block counted)."""
        return self._touched

    def allocate(self) -> int | None:
        fresh = not self._free or self._free[0] >= self._touched  # the next free one untouched
        if self._evictable and (fresh and len(self._evictable) >= self.retain_blocks):
            block = self._evict()
        elif self._free:
            block = heapq.heappop(self._free)
            self._touched = max(self._touched, block + 1)
        elif self._evictable:
            block = self._evict()
        else:
            return None
        self._ref[block] = 1
        if self.on_allocate is not None:
            self.on_allocate(block)
        return block

    def _evict(self) -> int:
        block, _ = self._evictable.popitem(last=False)
        if self.disk is not None:
            self.disk.spill(block, self._hash_of[block], self._tokens_of[block])
        self._forget(block)
        return block

    def release(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block] == 0:
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                heapq.heappush(self._free, block)

    def lookup(self, h: BlockHash, tokens: Sequence[int]) -> int | None:
        """A cached block holding exactly `tokens` after the chain `h`, now referenced."""
        block = self._by_hash.get(h)
        if block is None and self.disk is not None and self.disk.has(h):
            return self._restored(h, tuple(tokens))
        if block is None or self._tokens_of.get(block) != tuple(tokens):
            return None
        if self._ref[block] == 0:
            self._evictable.pop(block, None)
        self._ref[block] += 1
        return block

    def _restored(self, h: BlockHash, tokens: tuple[int, ...]) -> int | None:
        """A fresh block holding `h` read from the disk cache, registered and referenced."""
        assert self.disk is not None
        block = self.allocate()
        if block is None:
            return None
        if not self.disk.restore(block, h, tokens):
            self.release(block)
            return None
        self.register(block, h, tokens)
        return block

    def cached_blocks(self) -> list[tuple[int, BlockHash, tuple[int, ...]]]:
        """Every cached block (block, hash, tokens): those in use, then the released ones, the
        most recently released first."""
        released = list(reversed(self._evictable))
        used = [b for b in self._hash_of if b not in self._evictable]
        return [(b, self._hash_of[b], self._tokens_of[b]) for b in used + released]

    def register(self, block: int, h: BlockHash, tokens: Sequence[int]) -> None:
        if not self.prefix_caching or h in self._by_hash or block in self._hash_of:
            return
        self._hash_of[block] = h
        self._tokens_of[block] = tuple(tokens)
        self._by_hash[h] = block

    def _forget(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        self._tokens_of.pop(block, None)
        if h is not None and self._by_hash.get(h) == block:
            del self._by_hash[h]

    def reset_prefix_cache(self) -> None:
        for block in list(self._evictable):
            self._forget(block)
            heapq.heappush(self._free, block)
        self._evictable.clear()
