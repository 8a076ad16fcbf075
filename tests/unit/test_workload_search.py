"""The one goodput search, with fake probes: the bench's climb from ``rate_min`` and the
planner's start in the middle of a wide range, on the same code."""

from __future__ import annotations

import asyncio

import pytest

from splitserve_tools.workload.search import SearchSettings, find_goodput, find_goodput_async

THRESHOLD = 37.0


def step(rate: float) -> float:
    """Every request meets the SLOs up to ``THRESHOLD`` req/s, half of them above."""
    return 1.0 if rate <= THRESHOLD else 0.5


def test_climbs_by_doubling_then_bisects_to_the_tolerance() -> None:
    found = find_goodput(step, 0.9, SearchSettings(1.0, 1000.0, rel_tol=0.02))
    rates = [rate for rate, _ in found.probes]
    assert rates[:7] == [1, 2, 4, 8, 16, 32, 64]
    assert THRESHOLD / 1.02 <= found.goodput_rps <= THRESHOLD
    assert found.goodput_rps == max(r for r, a in found.probes if a >= 0.9)
    best = rates[0]  # no probe runs above twice the best rate passed before it
    for rate, attained in found.probes[1:]:
        assert rate <= 2 * best
        if attained >= 0.9:
            best = max(best, rate)


def test_max_probes_ends_the_search_at_the_best_rate_so_far() -> None:
    found = find_goodput(step, 0.9, SearchSettings(1.0, 1000.0, max_probes=8))
    assert len(found.probes) == 8
    assert found.goodput_rps == 32.0 < THRESHOLD  # the bisection had one probe: sqrt(32·64)


def test_edges_of_the_range() -> None:
    everything = find_goodput(lambda _: 1.0, 0.9, SearchSettings(100.0, 400.0))
    assert (everything.goodput_rps, [r for r, _ in everything.probes]) == (400.0, [100, 200, 400])
    nothing = find_goodput(lambda _: 0.0, 0.9, SearchSettings(100.0, 400.0))
    assert (nothing.goodput_rps, [r for r, _ in nothing.probes]) == (0.0, [100.0])


def test_a_start_above_the_goodput_halves_down_to_it() -> None:
    settings = SearchSettings(1e-3, 1e5, start=1000.0, rel_tol=0.02)
    found = find_goodput(step, 0.9, settings)
    assert [r for r, _ in found.probes][:6] == [1000, 500, 250, 125, 62.5, 31.25]
    assert THRESHOLD / 1.02 <= found.goodput_rps <= THRESHOLD
    nothing = find_goodput(lambda _: 0.0, 0.9, settings)
    assert nothing.goodput_rps == 0.0 and nothing.probes[-1][0] == 1e-3


def test_the_async_driver_probes_the_same_rates() -> None:
    async def probe(rate: float) -> float:
        await asyncio.sleep(0)
        return step(rate)

    settings = SearchSettings(0.5, 500.0, max_probes=10)
    assert asyncio.run(find_goodput_async(probe, 0.9, settings)) == find_goodput(
        step, 0.9, settings
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rate_min": 0.0, "rate_max": 1.0},
        {"rate_min": 2.0, "rate_max": 1.0},
        {"rate_min": 1.0, "rate_max": 2.0, "growth": 1.0},
        {"rate_min": 1.0, "rate_max": 2.0, "max_probes": 1},
    ],
)
def test_settings_are_checked(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SearchSettings(**kwargs)  # type: ignore[arg-type]
