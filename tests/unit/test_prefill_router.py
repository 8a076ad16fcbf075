"""PrefillRouter: least outstanding, round-robin ties, failure backoff and recovery, discovery
updates, and the all-down fallback; driven by a fake clock."""

from __future__ import annotations

import pytest

from splitserve.serving.prefill_router import PrefillRouter
from splitserve.serving.prefix_affinity import PrefixAffinity


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def router_of(clock: Clock, *servers: str) -> PrefillRouter:
    return PrefillRouter(servers, clock=clock)


def test_fewest_outstanding_wins(clock: Clock) -> None:
    router = router_of(clock, "a:1", "b:1", "c:1")
    router.begin("a:1")
    router.begin("a:1")
    router.begin("b:1")
    assert router.pick() == "c:1"
    router.begin("c:1")
    assert router.pick() == "b:1"
    router.end("a:1")
    router.end("a:1")
    assert router.pick() == "a:1"
    assert router.counts()["outstanding"] == 2


def test_ties_go_round_robin_in_name_order(clock: Clock) -> None:
    router = router_of(clock, "c:1", "a:1", "b:1")
    assert [router.pick() for _ in range(5)] == ["a:1", "b:1", "c:1", "a:1", "b:1"]


def test_exclude(clock: Clock) -> None:
    router = router_of(clock, "a:1", "b:1")
    assert router.pick(exclude={"a:1"}) == "b:1"
    assert router.pick(exclude={"a:1", "b:1"}) is None
    assert router_of(clock).pick() is None


def test_failure_backoff_doubles_up_to_the_cap_and_success_resets(clock: Clock) -> None:
    router = router_of(clock, "a:1", "b:1")
    backoffs = [router.mark_failed("a:1") for _ in range(7)]
    assert backoffs == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert router.down() == ["a:1"]
    assert [router.pick() for _ in range(3)] == ["b:1"] * 3
    clock.now += 29.9
    assert not router.is_up("a:1")
    clock.now += 0.2
    # Backoff over: back in rotation, on probation (the next failure doubles on).
    assert router.is_up("a:1") and router.down() == []
    assert router.mark_failed("a:1") == 30.0
    router.mark_ok("a:1")
    assert router.is_up("a:1")
    assert router.mark_failed("a:1") == 1.0


def test_probe_recovery_before_backoff_ends(clock: Clock) -> None:
    router = router_of(clock, "a:1", "b:1")
    router.mark_failed("b:1", now=clock.now)
    assert router.counts() == {
        "servers": 2,
        "servers_up": 1,
        "servers_down": 1,
        "outstanding": 0,
        "routed_by_prefix": 0,
    }
    router.mark_ok("b:1")
    assert router.counts()["servers_up"] == 2
    assert {router.pick(), router.pick()} == {"a:1", "b:1"}


def test_all_down_picks_the_soonest_back(clock: Clock) -> None:
    router = router_of(clock, "a:1", "b:1", "c:1")
    router.mark_failed("a:1")
    router.mark_failed("a:1")  # 2 s
    clock.now += 0.5
    router.mark_failed("b:1")  # 1 s: back at +1.5
    router.mark_failed("c:1")
    router.mark_failed("c:1")  # back at +2.5
    assert router.pick() == "b:1"
    assert router.pick(exclude={"b:1"}) == "a:1"  # back at +2.0
    assert router.pick(exclude={"a:1", "b:1"}) == "c:1"
    # One back in rotation beats every down one, however loaded.
    clock.now += 1.2  # b back (at +1.5), a and c not yet
    router.begin("b:1")
    router.begin("b:1")
    assert router.pick() == "b:1"


def test_update_adds_and_drops_but_in_flight_calls_still_count(clock: Clock) -> None:
    router = router_of(clock, "a:1", "b:1")
    router.begin("b:1")
    router.mark_failed("a:1")
    router.update({"b:1", "c:1"})
    assert router.servers == {"b:1", "c:1"}
    assert router.pick() == "c:1"  # new servers join healthy and idle
    router.update({"c:1"})
    assert router.outstanding("b:1") == 1 and router.counts()["outstanding"] == 1
    router.end("b:1")
    assert router.outstanding("b:1") == 0 and router.counts()["outstanding"] == 0
    # Reports about servers no longer known are ignored.
    assert router.mark_failed("b:1") == 0.0
    router.mark_ok("b:1")
    assert router.servers == {"c:1"}
    # A server that leaves and returns starts afresh.
    router.update({"a:1", "c:1"})
    assert router.is_up("a:1")


def test_end_never_goes_negative(clock: Clock) -> None:
    router = router_of(clock, "a:1")
    router.end("a:1")
    router.begin("a:1")
    assert router.outstanding("a:1") == 1
    router.end("a:1")
    router.end("a:1")
    assert router.outstanding("a:1") == 0


SYSTEM = list(range(1, 65))  # 4 blocks of 16


def test_a_repeated_prefix_goes_where_it_went_while_load_allows(clock: Clock) -> None:
    router = router_of(clock, "a:1", "b:1", "c:1")
    hashes = router.affinity.hashes
    first = router.pick(prefix=hashes([*SYSTEM, 7, 8]))
    other = router.pick(prefix=hashes([99] * 40))
    assert first != other
    # A later turn of the conversation: its prompt repeats the first one.
    router.begin(first)
    router.begin(first)  # within the bound: 2 more in flight than the least loaded
    assert router.pick(prefix=hashes([*SYSTEM, 7, 8, 9, 10])) == first
    assert router.counts()["routed_by_prefix"] == 1
    router.begin(first)  # beyond it: load wins
    assert router.pick(prefix=hashes([*SYSTEM, 1])) != first


def test_the_longest_match_wins_and_a_failed_server_is_forgotten(clock: Clock) -> None:
    router = router_of(clock, "a:1", "b:1")
    hashes = router.affinity.hashes
    assert router.pick(prefix=hashes(SYSTEM[:32])) == "a:1"  # 2 blocks
    router.affinity.routed("b:1", hashes(SYSTEM))  # b was sent all 4
    assert router.pick(prefix=hashes([*SYSTEM, 5])) == "b:1"
    assert router.pick(prefix=hashes(SYSTEM[:32])) == "a:1"  # equal matches: by load, name
    router.mark_failed("b:1")
    assert router.affinity.matched("b:1", hashes(SYSTEM)) == 0
    router.update({"a:1"})
    assert router.affinity.matched("a:1", hashes(SYSTEM)) == 2  # kept: a is still known


def test_affinity_forgets_the_least_recently_routed_blocks_beyond_its_capacity() -> None:
    affinity = PrefixAffinity(block_size=4, capacity=3)
    old, new = affinity.hashes([1, 2, 3, 4, 5, 6, 7, 8]), affinity.hashes([9] * 8)
    affinity.routed("s", old)
    affinity.routed("s", new)
    assert affinity.matched("s", old) == 0 and affinity.matched("s", new) == 2
    with pytest.raises(ValueError, match="positive"):
        PrefixAffinity(block_size=0)


def test_least_loaded_routing_ignores_prefixes(clock: Clock) -> None:
    router = PrefillRouter(("a:1", "b:1"), clock=clock, affinity_slack=None)
    prefix = router.affinity.hashes(SYSTEM)
    assert [router.pick(prefix=prefix) for _ in range(3)] == ["a:1", "b:1", "a:1"]
    assert router.counts()["routed_by_prefix"] == 0
