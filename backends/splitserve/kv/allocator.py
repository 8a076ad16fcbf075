"""Block allocator: hands out block ids of one pool and accounts for every one of them."""

from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockAllocator:
    """Free list over ``num_blocks`` ids: lowest ids go out first, and freed ids are handed out
    again before any never-used one (in the order they were freed), so a server touches only
    the memory of its peak working set, not the whole pool as its traffic cycles through it.

    Every id is either free or used, never both; freeing an id that is not in use raises.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
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
        ids = [self._free.popleft() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        bad = [i for i in ids if i not in self._used]
        if bad or len(set(ids)) != len(ids):
            raise ValueError(f"blocks not in use or freed twice: {bad or ids}")
        self._used.difference_update(ids)
        self._free.extendleft(reversed(ids))
