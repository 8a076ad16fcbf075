"""Goodput: the highest request rate at which enough requests meet both SLOs (DistServe)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from splitserve_client.stream import RequestRecord
from splitserve_tools.bench.metrics import SLO, Summary, attainment, summarize
from splitserve_tools.bench.runner import Schedule, run_schedule
from splitserve_tools.bench.target import Target

ScheduleFactory = Callable[[float], Schedule]
"""A fresh schedule of the benchmark's requests arriving at the given rate."""


@dataclass(frozen=True)
class Probe:
    """One run of the whole schedule at one rate."""

    rate: float
    summary: Summary
    records: list[RequestRecord]
    duration_s: float


@dataclass(frozen=True)
class GoodputResult:
    goodput_rps: float
    """Highest probed rate that met the attainment; 0 if even ``rate_min`` missed."""
    probes: list[Probe]
    """In the order they ran."""


async def probe(
    target: Target, schedule_for: ScheduleFactory, rate: float, slo: SLO, progress: bool = True
) -> Probe:
    run = await run_schedule(
        target, schedule_for(rate), progress=progress, desc=f"{target.name} @ {rate:.3g} req/s"
    )
    return Probe(rate, summarize(run.records, slo, run.duration_s), run.records, run.duration_s)


async def search_goodput(
    target: Target,
    schedule_for: ScheduleFactory,
    slo: SLO,
    *,
    rate_min: float,
    rate_max: float,
    min_attainment: float = 0.9,
    max_probes: int = 8,
    rel_tol: float = 0.05,
    growth: float = 2.0,
    progress: bool = True,
) -> GoodputResult:
    """Probe ``rate_min``, then climb by ``growth`` (capped at ``rate_max``) until a probe
    misses, then bisect (geometrically) between the highest rate that passed and the lowest that
    missed, until they are within ``rel_tol`` or ``max_probes`` runs are spent. A probe passes
    when its attainment is at least ``min_attainment``.

    Climbing from below means no probe runs right after one far past the target's capacity: a
    server flooded at many times its goodput keeps part of that state (slower steps, fuller
    queues) into the next probe, which would then measure the flood as much as its own rate."""
    if not 0 < rate_min <= rate_max or max_probes < 2 or growth <= 1:
        raise ValueError("need 0 < rate_min <= rate_max, max_probes >= 2 and growth > 1")
    probes: list[Probe] = []

    async def passes(rate: float) -> bool:
        probes.append(await probe(target, schedule_for, rate, slo, progress))
        return probes[-1].summary.attainment >= min_attainment

    if not await passes(rate_min):
        return GoodputResult(0.0, probes)
    lo, hi = rate_min, None
    while len(probes) < max_probes:
        if hi is None:
            if lo >= rate_max:
                break
            rate = min(lo * growth, rate_max)
        elif hi / lo > 1 + rel_tol:
            rate = math.sqrt(lo * hi)
        else:
            break
        if await passes(rate):
            lo = rate
        else:
            hi = rate
    return GoodputResult(lo, probes)


def slo_scale_sweep(
    records: Sequence[RequestRecord], slo: SLO, scales: Sequence[float]
) -> dict[float, float]:
    """Attainment of one run when both SLOs are multiplied by each scale (DistServe's plot)."""
    return {scale: attainment(records, slo.scaled(scale)) for scale in scales}
