"""Goodput (DistServe): the highest request rate at which a run still meets the attainment
target, found by probing rates.

The first probe runs at ``start``. While every probe passes, the rate grows by ``growth`` up to
``rate_max``; while every probe misses, it shrinks by ``growth`` down to ``rate_min``. Once a
passing and a missing rate are known, the search bisects between them geometrically until they
are within ``rel_tol`` of each other or ``max_probes`` runs are spent.

Climbing from ``rate_min`` (the default start) means no probe runs right after one far past
the target's capacity: a real server flooded at many times its goodput keeps part of that
state (slower steps, fuller queues) into the next probe. The bench climbs so; the planner's
simulated runs carry nothing over, so it starts in the middle of a wide range instead.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class SearchSettings:
    rate_min: float
    rate_max: float
    start: float | None = None
    """First rate probed (clamped into the range); ``rate_min`` when None."""
    growth: float = 2.0
    rel_tol: float = 0.05
    max_probes: int | None = None
    """None: as many as the bisection needs."""

    def __post_init__(self) -> None:
        if not 0 < self.rate_min <= self.rate_max or self.growth <= 1 or self.rel_tol <= 0:
            raise ValueError("need 0 < rate_min <= rate_max, growth > 1 and rel_tol > 0")
        if self.max_probes is not None and self.max_probes < 2:
            raise ValueError("max_probes must be at least 2")

    @property
    def first_rate(self) -> float:
        start = self.rate_min if self.start is None else self.start
        return min(max(start, self.rate_min), self.rate_max)


@dataclass(frozen=True)
class Found:
    goodput_rps: float
    """Highest probed rate that met the target; 0 if even the lowest probed missed."""
    probes: tuple[tuple[float, float], ...]
    """(rate, attainment) of every probe, in the order they ran."""


class RateSearch:
    """The search's state: which rate to probe next, given the attainments seen so far."""

    def __init__(self, target: float, settings: SearchSettings) -> None:
        self.target = target
        self.settings = settings
        self.probes: list[tuple[float, float]] = []
        self.passed: float | None = None
        """Highest rate that met the target."""
        self.missed: float | None = None
        """Lowest rate above ``passed`` that missed it."""

    def next_rate(self) -> float | None:
        """The rate to probe next; None when the search is over."""
        s = self.settings
        if not self.probes:
            return s.first_rate
        if s.max_probes is not None and len(self.probes) >= s.max_probes:
            return None
        lo, hi = self.passed, self.missed
        if lo is None:
            assert hi is not None
            return max(hi / s.growth, s.rate_min) if hi > s.rate_min else None
        if hi is None:
            return min(lo * s.growth, s.rate_max) if lo < s.rate_max else None
        return math.sqrt(lo * hi) if hi / lo > 1 + s.rel_tol else None

    def record(self, rate: float, attainment: float) -> None:
        self.probes.append((rate, attainment))
        if attainment >= self.target:
            self.passed = rate
        else:
            self.missed = rate

    def found(self) -> Found:
        return Found(self.passed or 0.0, tuple(self.probes))


def find_goodput(probe: Callable[[float], float], target: float, settings: SearchSettings) -> Found:
    """Run ``probe`` (rate -> attainment) at the rates the search picks."""
    search = RateSearch(target, settings)
    while (rate := search.next_rate()) is not None:
        search.record(rate, probe(rate))
    return search.found()


async def find_goodput_async(
    probe: Callable[[float], Awaitable[float]], target: float, settings: SearchSettings
) -> Found:
    """``find_goodput`` for a probe that runs on the event loop (a real server)."""
    search = RateSearch(target, settings)
    while (rate := search.next_rate()) is not None:
        search.record(rate, await probe(rate))
    return search.found()
