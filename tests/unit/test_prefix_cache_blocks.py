"""Prefix caching's pure parts: block hashes, the caching allocator, the scheduler's use."""

from __future__ import annotations

import pytest

from splitserve.engine.prefix import PrefixCache
from splitserve.engine.request import Request
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import Scheduler, SchedulerLimits
from splitserve.kv.allocator import BlockAllocator
from splitserve.kv.block_hash import extend_hashes, layout_key
from splitserve.kv.layout import KVLayout
from splitserve.kv.lease import LockedAllocator

BS = 4
KEY = b"k"


def hashes(tokens: list[int], key: bytes = KEY) -> list[bytes]:
    return extend_hashes([], tokens, BS, key, len(tokens))


def test_hashes_chain_over_every_token_before_and_the_key() -> None:
    a = hashes(list(range(10)))
    assert len(a) == 2  # full blocks only
    assert hashes([*range(8), 99, 98]) == a  # the partial block is not hashed
    assert hashes([0, 1, 2, 3, 4, 5, 6, 7]) == a
    b = hashes([1, 1, 2, 3, 4, 5, 6, 7])
    assert b[0] != a[0] and b[1] != a[1]  # block 1 changes because block 0 did
    assert hashes(list(range(8)), b"other") != a
    grown = extend_hashes(a[:1], list(range(12)), BS, KEY, 3)
    assert grown == hashes(list(range(12)))
    wide = KVLayout(2, 2, 8, 16, "float32")
    assert layout_key(wide) != layout_key(KVLayout(2, 2, 8, 16, "bfloat16"))


def test_cached_blocks_are_shared_kept_after_release_and_evicted_last() -> None:
    a = BlockAllocator(4)
    ids = a.allocate(2)
    h = hashes(list(range(8)))
    assert a.cache(ids[0], h[0]) and a.cache(ids[1], h[1])
    assert a.acquire(h) == ids  # a second user
    a.free(ids)
    assert (a.num_used, a.num_cached_free) == (2, 0)
    a.free(ids)
    assert (a.num_used, a.num_free, a.num_cached, a.num_cached_free) == (0, 4, 2, 2)
    assert a.allocate(2) == [2, 3]  # uncached blocks first
    assert a.cached_prefix(h) == 2
    assert a.allocate(1) == [ids[1]] and a.num_evictions == 1  # the chain's tail first
    assert a.cached_prefix(h) == 1
    assert a.allocate(1) == [ids[0]]
    assert a.cached_prefix(h) == 0
    assert a.acquire(h) == []


def test_acquire_takes_the_longest_cached_run_and_cache_refuses_duplicates() -> None:
    a = BlockAllocator(6)
    ids = a.allocate(3)
    h = hashes(list(range(12)))
    a.cache(ids[0], h[0])
    a.cache(ids[2], h[2])  # block 1 not cached: the run stops at it
    assert a.acquire(h) == [ids[0]]
    other = a.allocate(1)
    assert not a.cache(other[0], h[0])  # another block holds that content
    assert not a.cache(ids[0], h[1])  # this block holds other content
    assert a.cache(ids[0], h[0])
    with pytest.raises(ValueError, match="not in use"):
        a.cache(5, h[1])
    a.free([ids[0]])
    a.free(ids + other)
    assert (a.num_used, a.num_free) == (0, 6)
    with pytest.raises(ValueError):
        a.free([ids[0]])


def test_a_locked_allocator_caches_alike() -> None:
    a = LockedAllocator(2)
    ids = a.allocate(1)
    h = hashes([1, 2, 3, 4])
    assert a.cache(ids[0], h[0]) and a.acquire(h) == ids


def _sched(blocks: int, budget: int = 64, chunked: bool = False) -> Scheduler:
    limits = SchedulerLimits(BS, 8, budget, chunked_prefill=chunked, prefix_cache=True)
    allocator = BlockAllocator(blocks)
    return Scheduler(allocator, limits, prefix=PrefixCache(allocator, BS, KEY))


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8))


def _run(s: Scheduler) -> list[tuple[str, int, int]]:
    """One step as the engine runs it: (id, first token computed, tokens) per prefill."""
    plan = s.schedule()
    done = [(r.request_id, r.num_computed, n) for r, n in plan.prefills]
    for req, n in plan.prefills:
        req.num_computed += n
        assert s.prefix is not None
        s.prefix.commit(req)
    return done


def test_a_repeated_prefix_is_computed_once_and_the_last_token_always() -> None:
    s = _sched(16)
    first = _req("a", list(range(1, 11)))  # 10 tokens: 2 full blocks
    s.add(first)
    assert _run(s) == [("a", 0, 10)]
    second = _req("b", [*range(1, 9), 50, 51, 52])
    same = _req("c", list(range(1, 9)))  # an exact prefix: its last block is recomputed
    s.add(second)
    s.add(same)
    assert _run(s) == [("b", 8, 3), ("c", 4, 4)]
    assert second.block_ids[:2] == first.block_ids[:2]
    assert same.block_ids[0] == first.block_ids[0] and same.block_ids[1] != first.block_ids[1]
    assert s.prefix is not None
    assert (s.prefix.stats.queries, s.prefix.stats.hits) == (10 + 11 + 8, 8 + 4)
    for req in (first, second, same):
        s.remove(req)
    assert s.allocator.num_used == 0 and s.allocator.num_cached == 2  # c's copy: not cached


def test_a_request_that_cannot_be_scheduled_gives_its_cached_blocks_back() -> None:
    s = _sched(4)
    first = _req("a", list(range(1, 9)))
    s.add(first)
    _run(s)
    s.remove(first)  # 2 cached blocks, free
    hog = _req("h", list(range(100, 108)))
    s.add(hog)
    _run(s)  # takes the 2 uncached blocks
    big = _req("b", [*range(1, 9), *range(20, 29)])  # 2 cached + 3 new blocks: no room
    s.add(big)
    assert _run(s) == []
    assert big.block_ids == [] and big.num_computed == 0
    assert (s.allocator.num_used, s.allocator.num_cached_free) == (2, 2)
    assert s.prefix is not None and s.prefix.stats.queries == 8 + 8


def test_decoded_tokens_fill_blocks_that_are_cached_too() -> None:
    s = _sched(16)
    req = _req("a", [1, 2, 3])
    s.add(req)
    _run(s)
    req.output_ids += [4, 5]  # two decode steps' tokens; the KV of 4 is computed
    req.num_computed = 4
    assert s.prefix is not None
    s.prefix.commit(req)
    assert req.num_cached_blocks == 1
    assert s.allocator.cached_prefix(hashes([1, 2, 3, 4])) == 1
