"""Goodput of a real target: probes that run the whole schedule at one rate, driven by the one
search of ``splitserve_tools.workload.search``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from splitserve_client.stream import RequestRecord
from splitserve_tools.bench.metrics import Summary, records_attainment, summarize
from splitserve_tools.bench.requests import Request
from splitserve_tools.bench.runner import Schedule, run_schedule
from splitserve_tools.bench.target import Target
from splitserve_tools.workload.search import SearchSettings, find_goodput_async
from splitserve_tools.workload.slo import SLO

ScheduleFactory = Callable[[float], Schedule]
"""A fresh schedule of the benchmark's requests arriving at the given rate."""


@dataclass(frozen=True)
class Probe:
    """One run of the whole schedule at one rate."""

    rate: float
    summary: Summary
    records: list[RequestRecord]
    duration_s: float
    requests: list[Request]
    """What was sent, in the records' order (a session workload's probes differ in count)."""


@dataclass(frozen=True)
class GoodputResult:
    goodput_rps: float
    """Highest probed rate that met the attainment; 0 if even ``rate_min`` missed."""
    probes: list[Probe]
    """In the order they ran."""


async def probe(
    target: Target, schedule_for: ScheduleFactory, rate: float, slo: SLO, progress: bool = True
) -> Probe:
    schedule = schedule_for(rate)
    run = await run_schedule(
        target, schedule, progress=progress, desc=f"{target.name} @ {rate:.3g} req/s"
    )
    summary = summarize(run.records, slo, run.duration_s)
    return Probe(rate, summary, run.records, run.duration_s, [r for _, r in schedule])


async def search_goodput(
    target: Target,
    schedule_for: ScheduleFactory,
    slo: SLO,
    settings: SearchSettings,
    progress: bool = True,
) -> GoodputResult:
    """The highest rate whose run meets ``slo.attainment``, every run kept."""
    probes: list[Probe] = []

    async def attainment_at(rate: float) -> float:
        probes.append(await probe(target, schedule_for, rate, slo, progress))
        return probes[-1].summary.attainment

    found = await find_goodput_async(attainment_at, slo.attainment, settings)
    return GoodputResult(found.goodput_rps, probes)


def slo_scale_sweep(
    records: Sequence[RequestRecord], slo: SLO, scales: Sequence[float]
) -> dict[float, float]:
    """Attainment of one run when both SLOs are multiplied by each scale (DistServe's plot)."""
    return {scale: records_attainment(records, slo.scaled(scale)) for scale in scales}
