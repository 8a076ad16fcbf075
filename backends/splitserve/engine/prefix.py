"""Prefix caching for one engine's requests, over its pool's allocator (``kv.allocator``).

A request that computes its prompt from token 0 first takes the longest run of its full blocks
that the pool has cached, and computes only the rest; as its blocks fill (prompt or output
tokens), they are cached for later requests. At least the last token is always computed: its
logits give the next token.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields

from splitserve.engine.request import Request
from splitserve.kv.allocator import BlockAllocator
from splitserve.kv.block_hash import extend_hashes


@dataclass
class PrefixStats:
    queries: int = 0
    """Prompt tokens looked up (each time a request starts its prompt)."""
    hits: int = 0
    """Of those, tokens whose KV came from the cache."""
    blocks_pulled: int = 0
    """Blocks of handed-over prompts pulled from their owner."""
    blocks_skipped: int = 0
    """Blocks of handed-over prompts not pulled: this pool had them cached."""

    @classmethod
    def total(cls, parts: Iterable[PrefixStats]) -> PrefixStats:
        """The counts of several caches summed."""
        out = cls()
        for part in parts:
            for f in fields(cls):
                setattr(out, f.name, getattr(out, f.name) + getattr(part, f.name))
        return out


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, block_size: int, key: bytes) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.key = key
        self.stats = PrefixStats()

    def _hashes(self, req: Request, blocks: int) -> list[bytes]:
        return extend_hashes(req.block_hashes, req.all_ids, self.block_size, self.key, blocks)

    def attach(self, req: Request) -> None:
        """Give ``req``, which holds no block, the cached blocks of its longest cached prefix
        (up to, not including, the block of its last token) as computed."""
        assert req.num_computed == 0
        taken = self._acquire(req, (req.num_tokens - 1) // self.block_size)
        req.num_computed = taken * self.block_size

    def held_prefix(self, req: Request) -> int:
        """Blocks that ``attach`` would give ``req`` (no block yet) and that others hold now:
        they cost the pool no free block."""
        blocks = (req.num_tokens - 1) // self.block_size
        return self.allocator.held_prefix(self._hashes(req, blocks)[:blocks])

    def attach_arrived(self, req: Request) -> int:
        """Give a handed-over ``req`` (its prompt computed elsewhere), which holds no block,
        the cached blocks of its longest cached run of full prompt blocks; their count."""
        return self._acquire(req, req.num_computed // self.block_size)

    def _acquire(self, req: Request, blocks: int) -> int:
        """``req`` (no block yet) takes the cached blocks of its longest cached run among its
        first ``blocks``; their count. The owner frees them as it frees the request's blocks."""
        assert not req.block_ids
        req.block_ids = self.allocator.acquire(self._hashes(req, blocks)[:blocks])
        req.num_cached_blocks = len(req.block_ids)
        return req.num_cached_blocks

    def count_arrived(self, req: Request, skipped: int) -> None:
        """``req`` is admitted: all but ``skipped`` of its prompt's blocks will be pulled."""
        self.stats.blocks_skipped += skipped
        self.stats.blocks_pulled += -(-req.num_computed // self.block_size) - skipped

    def count(self, req: Request) -> None:
        """``req`` starts its prompt with what ``attach`` gave it."""
        self.stats.queries += req.num_tokens
        self.stats.hits += req.num_computed

    def commit(self, req: Request, computed: int | None = None) -> None:
        """Cache the blocks of ``req`` whose KV is complete (that of its first ``computed``
        tokens; default ``num_computed``) and that the cache does not know."""
        tokens = req.num_computed if computed is None else computed
        full = min(tokens // self.block_size, len(req.block_ids))
        if full <= req.num_cached_blocks:
            return
        hashes = self._hashes(req, full)
        for i in range(req.num_cached_blocks, full):
            self.allocator.cache(req.block_ids[i], hashes[i])
        req.num_cached_blocks = full
