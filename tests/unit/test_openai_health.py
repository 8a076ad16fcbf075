"""``/health``'s readiness state: what a run of checks makes of it (``openai_api.health``)."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.openai.health import Probe, Readiness


def probe_of(*answers: bool | Exception) -> tuple[list[int], Probe]:
    """A probe answering ``answers`` in turn (an exception is raised); and its call count."""
    calls = [0]

    async def probe() -> bool:
        answer = answers[min(calls[0], len(answers) - 1)]
        calls[0] += 1
        if isinstance(answer, Exception):
            raise answer
        return answer

    return calls, probe


async def hangs() -> bool:
    await asyncio.sleep(3600)
    return True


def test_not_ready_until_first_seen_ready() -> None:
    readiness = Readiness(failures=3)
    assert not readiness.ready
    _, probe = probe_of(False)
    asyncio.run(readiness.check(probe))
    assert not readiness.ready
    _, probe = probe_of(True)
    asyncio.run(readiness.check(probe))
    assert readiness.ready


def test_only_a_run_of_failures_makes_it_not_ready() -> None:
    readiness = Readiness(timeout_s=0.05, failures=3)

    async def run() -> list[bool]:
        seen = []
        _, ready = probe_of(True)
        _, refused = probe_of(ConnectionError("refused"))
        _, not_ready = probe_of(False)
        for probe in (ready, refused, hangs, ready, not_ready, refused, hangs, ready):
            await readiness.check(probe)
            seen.append(readiness.ready)
        return seen

    # Two failures in a row (an error, a timeout) change nothing; the third does; one answer
    # of "ready" makes it ready again.
    assert asyncio.run(run()) == [True, True, True, True, True, True, False, True]


def test_shutting_down_is_not_ready() -> None:
    readiness = Readiness()
    _, probe = probe_of(True)
    asyncio.run(readiness.check(probe))
    readiness.shutting_down()
    asyncio.run(readiness.check(probe))
    assert not readiness.ready


def test_watch_checks_at_its_interval() -> None:
    readiness = Readiness(interval_s=0.01, failures=2)
    calls, probe = probe_of(True, True, True, False)

    async def run() -> None:
        watch = asyncio.create_task(readiness.watch(probe))
        await asyncio.sleep(0.3)
        watch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watch

    asyncio.run(run())
    assert calls[0] >= 5
    assert not readiness.ready


def test_watch_stops_when_cancelled_as_its_probe_answers() -> None:
    """A cancel that lands while a check's probe answers still stops ``watch`` (Python 3.11's
    ``asyncio.wait_for`` lost such cancels, and the watch ran on)."""

    async def lost_cancels() -> int:
        lost = 0
        for _ in range(200):
            _, probe = probe_of(True)
            watch = asyncio.create_task(Readiness(interval_s=0.0).watch(probe))
            await asyncio.sleep(0.001)
            watch.cancel()
            for _ in range(5):
                await asyncio.sleep(0)
            if not watch.done():
                lost += 1
                while not watch.done():  # cancel again until it lands, so the run can end
                    watch.cancel()
                    await asyncio.sleep(0)
        return lost

    assert asyncio.run(lost_cancels()) == 0
