"""The open-loop runner and the goodput search, against in-process fake targets (pure asyncio)."""

from __future__ import annotations

import asyncio
import time

import pytest

from splitserve_client.stream import RequestRecord
from splitserve_tools.bench.goodput import search_goodput
from splitserve_tools.bench.requests import Request
from splitserve_tools.bench.runner import Schedule, run_schedule
from splitserve_tools.workload.arrivals import arrival_times
from splitserve_tools.workload.search import SearchSettings
from splitserve_tools.workload.slo import SLO

REQ = Request("hi", 2, 4)
THRESHOLD = 50.0


class LoadTarget:
    """A saturating server: TTFT = base · in_flight, token gap = base_tpot · (1 + in_flight/4).
    Its times are tens of milliseconds, so that an event loop a few milliseconds late on a
    loaded machine does not flip a probe (at 2 ms a base, one did in CI)."""

    def __init__(self, ttft_s: float = 0.02, tpot_s: float = 0.01) -> None:
        self.name = "fake-load"
        self.ttft_s, self.tpot_s = ttft_s, tpot_s
        self.in_flight = 0
        self.sent: list[float] = []

    async def generate(self, prompt: str, max_tokens: int) -> RequestRecord:
        record = RequestRecord(start=time.perf_counter())
        self.sent.append(record.start)
        self.in_flight += 1
        try:
            await asyncio.sleep(self.ttft_s * self.in_flight)
            record.token_times.append(time.perf_counter())
            for _ in range(max_tokens - 1):
                await asyncio.sleep(self.tpot_s * (1 + self.in_flight / 4))
                record.token_times.append(time.perf_counter())
        finally:
            self.in_flight -= 1
        record.output_tokens = len(record.token_times)
        record.end = time.perf_counter()
        return record

    async def close(self) -> None:
        pass


class RateTarget:
    """Answers at once: TTFT 10 ms up to ``THRESHOLD`` req/s, 2 s above; the schedule factory
    sets ``rate``. The TTFT SLOs the tests use sit far from both, so a late event loop on a
    loaded machine (latency counts from the scheduled arrival) cannot flip a probe."""

    name = "fake-rate"
    rate = 0.0

    async def generate(self, prompt: str, max_tokens: int) -> RequestRecord:
        now = time.perf_counter()
        ttft = 0.010 if self.rate <= THRESHOLD else 2.0
        times = [now + ttft + 0.001 * i for i in range(max_tokens)]
        return RequestRecord(start=now, token_times=times, end=times[-1])

    async def close(self) -> None:
        pass


class FailingTarget:
    name = "fake-fail"

    async def generate(self, prompt: str, max_tokens: int) -> RequestRecord:
        raise ConnectionError("refused")

    async def close(self) -> None:
        pass


def fixed_schedule(rate: float, count: int) -> Schedule:
    return [(t, REQ) for t in arrival_times("fixed", rate, count).tolist()]


def test_runner_is_open_loop() -> None:
    """Requests go out at their arrival times even while earlier ones are still running."""
    target = LoadTarget(ttft_s=0.1)
    run = asyncio.run(run_schedule(target, fixed_schedule(100.0, 10), progress=False))
    assert len(run.records) == 10 and all(r.error is None for r in run.records)
    sent = [t - target.sent[0] for t in target.sent]
    assert sent == pytest.approx([i / 100 for i in range(10)], abs=0.04)  # closed loop: 0.1 apart


def test_runner_records_exceptions_as_errors() -> None:
    run = asyncio.run(run_schedule(FailingTarget(), fixed_schedule(1000.0, 3), progress=False))
    assert [r.error for r in run.records] == ["ConnectionError('refused')"] * 3


def test_runner_counts_latency_from_arrival_under_the_cap() -> None:
    """With one stream allowed, the second request's wait for it counts in its TTFT."""
    schedule = [(0.0, REQ), (0.0, REQ)]
    run = asyncio.run(
        run_schedule(LoadTarget(ttft_s=0.03), schedule, max_in_flight=1, progress=False)
    )
    first, second = sorted(run.records, key=lambda r: r.ttft)
    assert second.ttft >= first.e2e


def test_search_converges_on_the_threshold() -> None:
    target = RateTarget()

    def schedule_for(rate: float) -> Schedule:
        target.rate = rate
        return fixed_schedule(rate, 3)

    result = asyncio.run(
        search_goodput(
            target,
            schedule_for,
            SLO(0.5, 0.01),
            SearchSettings(20, 800, max_probes=12, rel_tol=0.02),
            progress=False,
        )
    )
    assert THRESHOLD / 1.02 <= result.goodput_rps <= THRESHOLD
    assert len(result.probes) <= 12
    for p in result.probes:
        assert (p.summary.attainment == 1.0) == (p.rate <= THRESHOLD)
    best = result.probes[0].rate  # no probe runs above twice the best rate passed before it
    for p in result.probes[1:]:
        assert p.rate <= 2 * best + 1e-9
        if p.summary.attainment == 1.0:
            best = max(best, p.rate)


def test_search_edges() -> None:
    target = RateTarget()

    def schedule_for(rate: float) -> Schedule:
        target.rate = rate
        return fixed_schedule(rate, 2)

    def search(ttft_slo: float) -> tuple[float, list[float]]:
        found = asyncio.run(
            search_goodput(
                target,
                schedule_for,
                SLO(ttft_slo, 1.0),
                SearchSettings(100, 400, max_probes=8),
                progress=False,
            )
        )
        return found.goodput_rps, [p.rate for p in found.probes]

    assert search(5.0) == (400, [100, 200, 400])  # everything passes: up to the top of the range
    assert search(0.005) == (0.0, [100])  # even rate_min misses


def test_goodput_of_a_saturating_target() -> None:
    """Latency grows with load: low rates pass, high rates fail, and the answer separates them."""
    target = LoadTarget()

    def schedule_for(rate: float) -> Schedule:
        return [(t, REQ) for t in arrival_times("poisson", rate, 30, seed=1).tolist()]

    result = asyncio.run(
        search_goodput(
            target,
            schedule_for,
            SLO(0.12, 0.03),
            SearchSettings(10, 300, max_probes=5),
            progress=False,
        )
    )
    assert 10 <= result.goodput_rps < 300
    assert len(result.probes) <= 5
    passed = [p.rate for p in result.probes if p.summary.attainment >= 0.9]
    failed = [p.rate for p in result.probes if p.summary.attainment < 0.9]
    assert max(passed) == result.goodput_rps
    assert min(failed) > result.goodput_rps
