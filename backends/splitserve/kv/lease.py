"""Owner-side leases: blocks lent to one reader until it releases them or the lease lapses.

Rules that keep a block owned by exactly one side at a time:

- ``grant`` takes the caller's reference to each block: it goes back to the allocator only
  through this table, exactly once, on ``release`` or ``expire``. Leases of prompts that share
  a cached prefix share its blocks, one reference each.
- The reader copies first and releases after. It refuses to start reading a handle with less
  than its read margin left before expiry (``decode_handle(..., margin_s=...)``), and announces
  the read (``mark_pulled``), which moves the owner's deadline to at least ``pull_ttl_s`` later;
  the owner's listener applies pending messages before each expiry sweep, so a read that began
  inside the margin is never freed under the reader.
- A release or pull for an unknown lease (replayed, already expired, invented) changes nothing
  and is counted.

Releases arrive on the transport's listener thread while the engine allocates on its own, so
the table is locked and the pool's allocator must be a ``LockedAllocator``.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from splitserve.kv.allocator import BlockAllocator


class LockedAllocator(BlockAllocator):
    """A ``BlockAllocator`` safe to share between the engine and a release thread."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self._lock = threading.Lock()

    def can_allocate(self, n: int) -> bool:
        with self._lock:
            return super().can_allocate(n)

    def allocate(self, n: int) -> list[int]:
        with self._lock:
            return super().allocate(n)

    def free(self, ids: list[int]) -> None:
        with self._lock:
            super().free(ids)

    def share(self, ids: list[int]) -> None:
        with self._lock:
            super().share(ids)

    def cache(self, block: int, content: bytes) -> bool:
        with self._lock:
            return super().cache(block, content)

    def acquire(self, hashes: Sequence[bytes]) -> list[int]:
        with self._lock:
            return super().acquire(hashes)


@dataclass(frozen=True)
class Lease:
    lease_id: bytes
    req_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    expiry: float


@dataclass(frozen=True)
class LeaseStats:
    outstanding: int
    outstanding_blocks: int
    granted: int
    pulled: int
    released: int
    expired: int
    unknown: int


class LeaseTable:
    """Outstanding leases of one pool; every lease ends once, by release or by expiry."""

    def __init__(
        self,
        free_blocks: Callable[[list[int]], None],
        *,
        pull_ttl_s: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._free_blocks = free_blocks
        self._pull_ttl_s = pull_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[bytes, Lease] = {}
        self._deadlines: dict[bytes, float] = {}
        self._leased_blocks: Counter[int] = Counter()
        """Leases per block: with prefix caching, leases of prompts that share a cached prefix
        share its blocks (each lease holds one reference of the pool's allocator)."""
        self._counts = dict.fromkeys(("granted", "pulled", "released", "expired", "unknown"), 0)

    def grant(
        self, block_ids: Iterable[int], num_tokens: int, ttl_s: float, req_id: str = ""
    ) -> Lease:
        """Lease ``block_ids`` (distinct) for ``ttl_s`` seconds; the lease holds one reference
        to each, which ``free_blocks`` drops when it ends."""
        ids = tuple(block_ids)
        if not ids or len(set(ids)) != len(ids):
            raise ValueError(f"a lease needs distinct block ids, got {list(ids)}")
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        lease = Lease(secrets.token_bytes(16), req_id, ids, num_tokens, self._clock() + ttl_s)
        with self._lock:
            self._leases[lease.lease_id] = lease
            self._deadlines[lease.lease_id] = lease.expiry
            self._leased_blocks.update(ids)
            self._counts["granted"] += 1
        return lease

    def mark_pulled(self, lease_id: bytes) -> bool:
        """A reader started copying: keep the blocks at least ``pull_ttl_s`` from now."""
        with self._lock:
            if lease_id not in self._leases:
                self._counts["unknown"] += 1
                return False
            deadline = max(self._deadlines[lease_id], self._clock() + self._pull_ttl_s)
            self._deadlines[lease_id] = deadline
            self._counts["pulled"] += 1
        return True

    def release(self, lease_id: bytes) -> bool:
        """Free the lease's blocks; False, freeing nothing, for an unknown or replayed id."""
        with self._lock:
            lease = self._pop(lease_id)
            self._counts["unknown" if lease is None else "released"] += 1
        if lease is None:
            return False
        self._free_blocks(list(lease.block_ids))
        return True

    def expire(self, now: float | None = None) -> list[bytes]:
        """Free every lease whose deadline is at or before ``now``; returns their ids."""
        now = self._clock() if now is None else now
        with self._lock:
            due = [lid for lid, deadline in self._deadlines.items() if deadline <= now]
            leases = [lease for lid in due if (lease := self._pop(lid)) is not None]
            self._counts["expired"] += len(leases)
        errors = []
        for lease in leases:
            try:
                self._free_blocks(list(lease.block_ids))
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        return due

    def stats(self) -> LeaseStats:
        with self._lock:
            return LeaseStats(
                outstanding=len(self._leases),
                outstanding_blocks=len(self._leased_blocks),
                **self._counts,
            )

    def _pop(self, lease_id: bytes) -> Lease | None:
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            del self._deadlines[lease_id]
            self._leased_blocks.subtract(lease.block_ids)
            for block in lease.block_ids:
                if not self._leased_blocks[block]:
                    del self._leased_blocks[block]
        return lease
