"""Block allocator: hands out block ids of one pool and accounts for every one of them."""

from __future__ import annotations

import heapq


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

    Every id is either free or used, never both; freeing an id that is not in use raises.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError("cannot allocate a negative number of blocks")
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} blocks, {len(self._free)} free")
        ids = [heapq.heappop(self._free) for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        bad = [i for i in ids if i not in self._used]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"blocks not in use or freed twice: {bad or ids}")
        self._used.difference_update(ids)
        for i in ids:
            heapq.heappush(self._free, i)
