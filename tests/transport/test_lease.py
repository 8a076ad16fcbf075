import threading

import pytest

from splitserve.kv.lease import LeaseTable, LockedAllocator


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def setup():
    alloc = LockedAllocator(16)
    clock = Clock()
    return alloc, clock, LeaseTable(alloc.free, pull_ttl_s=30.0, clock=clock)


def test_release_frees_exactly_once(setup):
    alloc, _, table = setup
    ids = alloc.allocate(4)
    lease = table.grant(ids, 60, ttl_s=10, req_id="r1")
    assert (lease.block_ids, lease.num_tokens, lease.req_id) == (tuple(ids), 60, "r1")
    assert alloc.num_free == 12
    assert table.release(lease.lease_id) is True
    assert alloc.num_free == 16
    assert table.release(lease.lease_id) is False
    assert table.release(b"x" * 16) is False
    assert alloc.num_free == 16
    s = table.stats()
    assert (s.outstanding, s.granted, s.released, s.expired, s.unknown) == (0, 1, 1, 0, 2)


def test_expire_frees_only_due_leases(setup):
    alloc, clock, table = setup
    short = table.grant(alloc.allocate(2), 1, ttl_s=5)
    long = table.grant(alloc.allocate(3), 1, ttl_s=50)
    assert table.expire(1004.9) == []
    assert table.expire(1005.0) == [short.lease_id]
    assert alloc.num_free == 16 - 3
    assert table.release(short.lease_id) is False
    clock.now = 2000.0
    assert table.expire() == [long.lease_id]
    assert alloc.num_free == 16
    s = table.stats()
    assert (s.outstanding, s.outstanding_blocks, s.expired, s.unknown) == (0, 0, 2, 1)


def test_pulled_lease_outlives_its_expiry_until_released(setup):
    alloc, clock, table = setup
    lease = table.grant(alloc.allocate(2), 1, ttl_s=5)
    clock.now = 1004.0
    assert table.mark_pulled(lease.lease_id) is True
    assert table.expire(1010.0) == []
    assert table.release(lease.lease_id) is True
    assert table.mark_pulled(lease.lease_id) is False
    assert alloc.num_free == 16


def test_pulled_lease_still_expires_after_pull_ttl(setup):
    alloc, _, table = setup
    lease = table.grant(alloc.allocate(2), 1, ttl_s=5)
    table.mark_pulled(lease.lease_id)
    assert table.expire(1029.0) == []
    assert table.expire(1030.0) == [lease.lease_id]
    assert alloc.num_free == 16


def test_grant_rejects_duplicates_and_bad_ttl(setup):
    alloc, _, table = setup
    ids = alloc.allocate(3)
    table.grant(ids[:2], 1, ttl_s=5)
    with pytest.raises(ValueError, match="distinct"):
        table.grant([ids[2], ids[2]], 1, ttl_s=5)
    with pytest.raises(ValueError, match="distinct"):
        table.grant([], 1, ttl_s=5)
    with pytest.raises(ValueError, match="ttl"):
        table.grant([ids[2]], 1, ttl_s=0)
    assert table.stats().outstanding == 1


def test_a_failing_free_does_not_strand_other_expired_leases(setup):
    alloc, _, table = setup
    first = alloc.allocate(2)
    table.grant(first, 1, ttl_s=5)
    table.grant(alloc.allocate(2), 1, ttl_s=5)
    alloc.free(first)
    with pytest.raises(ValueError, match="not in use"):
        table.expire(2000.0)
    assert alloc.num_free == 16 and table.stats().outstanding == 0


def test_concurrent_release_and_expire_free_each_lease_once():
    alloc = LockedAllocator(4000)
    table = LeaseTable(alloc.free)
    leases = [table.grant(alloc.allocate(4), 1, ttl_s=0.001) for _ in range(1000)]
    start = threading.Barrier(4)

    def releaser() -> None:
        start.wait()
        for lease in leases:
            table.release(lease.lease_id)

    def expirer() -> None:
        start.wait()
        for _ in range(200):
            table.expire(float("inf"))

    threads = [threading.Thread(target=f) for f in (releaser, releaser, releaser, expirer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = table.stats()
    assert alloc.num_free == 4000
    assert s.outstanding == 0 and s.released + s.expired == 1000
    assert s.unknown == 3 * 1000 - s.released


def test_locked_allocator_survives_concurrent_allocate_and_free():
    alloc = LockedAllocator(64)

    def churn() -> None:
        for _ in range(2000):
            alloc.free(alloc.allocate(3))

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (alloc.num_free, alloc.num_used) == (64, 0)


def test_leases_that_share_cached_blocks_hold_a_reference_each(setup):
    alloc, _, table = setup
    ids = alloc.allocate(3)
    alloc.share(ids[:2])  # a second prompt behind the same cached prefix, plus a block of its own
    first = table.grant(ids, 1, ttl_s=5)
    second = table.grant([*ids[:2], *alloc.allocate(1)], 1, ttl_s=5)
    assert table.stats().outstanding_blocks == 4
    assert table.release(first.lease_id)
    assert alloc.num_used == 3 and table.stats().outstanding_blocks == 3
    assert table.release(second.lease_id)
    assert alloc.num_used == 0 and table.stats().outstanding_blocks == 0
