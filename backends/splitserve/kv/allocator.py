"""Block allocator: hands out block ids of one pool and accounts for every one of them."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence


class OutOfBlocks(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlocksStillWritten(RuntimeError):
    """A copy into ``block_ids`` failed or was abandoned but may still write them (a network
    transfer that cannot be cancelled). Whoever raises it frees them once the copy has settled;
    the caller must not free or reuse them."""

    def __init__(self, message: str, block_ids: list[int]) -> None:
        super().__init__(message)
        self.block_ids = list(block_ids)


class BlockAllocator:
    """Free ids in a min-heap: every allocation takes the lowest free ids, in ascending order.

    A server therefore touches only the memory of its peak working set, and a sequence's blocks
    lie in ascending order over the low end of the pool however long it has been serving. Handing
    freed ids out again in the order they were freed (a LIFO list) scatters them after a burst:
    on the tiny checkpoint after 800 mixed requests, decode steps over blocks from such a list
    were 10-17 % slower than over the same blocks sorted (BENCHMARKS.md, "Goodput, ninth run").

    Prefix caching: a used block whose KV is complete may be ``cache``d under the hash of its
    content (``kv.block_hash``). Cached blocks are shared read-only: ``acquire`` takes one more
    reference to each block of the longest run of cached hashes. A cached block whose last
    reference is freed stays cached, free but evictable; ``allocate`` takes free uncached
    blocks first, then evicts the least recently freed cached ones.

    Every id is used (referenced), free or cached-and-free, never two of them; freeing an id
    that is not in use raises.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks))
        self._refs: dict[int, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        """Cached blocks nobody references, least recently freed first."""
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: free ones and cached ones nobody references."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        """Blocks the cache knows, used or not."""
        return len(self._block_of)

    @property
    def num_cached_free(self) -> int:
        """Cached blocks nobody references (counted in ``num_free`` too)."""
        return len(self._evictable)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks, uncached, referenced once each."""
        if n < 0:
            raise ValueError("cannot allocate a negative number of blocks")
        if n > self.num_free:
            raise OutOfBlocks(f"asked for {n} blocks, {self.num_free} free")
        ids = [heapq.heappop(self._free) for _ in range(min(n, len(self._free)))]
        while len(ids) < n:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
            self.num_evictions += 1
            ids.append(block)
        for i in ids:
            self._refs[i] = 1
        return ids

    def free(self, ids: list[int]) -> None:
        """Drop one reference to each id; a block nobody references is free again (cached
        ones evictable; a sequence's later blocks go first, since a prefix is matched from its
        first block and a lost first block strands the rest)."""
        bad = [i for i in ids if i not in self._refs]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"blocks not in use or freed twice: {bad or ids}")
        for i in reversed(ids):
            self._refs[i] -= 1
            if self._refs[i]:
                continue
            del self._refs[i]
            if i in self._hash_of:
                self._evictable[i] = None
            else:
                heapq.heappush(self._free, i)

    def share(self, ids: list[int]) -> None:
        """One more reference to each of these used blocks (a holder that frees them later)."""
        bad = [i for i in ids if i not in self._refs]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"blocks not in use or given twice: {bad or ids}")
        for i in ids:
            self._refs[i] += 1

    def cache(self, block: int, content: bytes) -> bool:
        """Record that used ``block`` holds the KV hashed as ``content``; False (and nothing
        changes) if another block already holds it or this one holds other content."""
        if block not in self._refs:
            raise ValueError(f"block {block} is not in use")
        known = self._hash_of.get(block)
        if known is not None:
            return known == content
        if content in self._block_of:
            return False
        self._hash_of[block] = content
        self._block_of[content] = block
        return True

    def cached_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many of ``hashes``, from the first, name cached blocks."""
        n = 0
        for h in hashes:
            if h not in self._block_of:
                break
            n += 1
        return n

    def held_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many blocks of the longest cached run of ``hashes`` from the first are in use:
        acquiring those takes nothing from ``num_free``."""
        ids = [self._block_of[h] for h in hashes[: self.cached_prefix(hashes)]]
        return sum(1 for i in ids if i in self._refs)

    def acquire(self, hashes: Sequence[bytes]) -> list[int]:
        """One more reference to the cached block of each hash of the longest cached run from
        the first: its ids, in order."""
        ids = [self._block_of[h] for h in hashes[: self.cached_prefix(hashes)]]
        for i in ids:
            if i in self._refs:
                self._refs[i] += 1
            else:
                del self._evictable[i]
                self._refs[i] = 1
        return ids
