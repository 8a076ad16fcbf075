"""Send a schedule of requests to a target at their arrival times (open loop, asyncio)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm import tqdm

from splitserve_client.stream import RequestRecord
from splitserve_tools.bench.requests import Request
from splitserve_tools.bench.target import Target

MAX_IN_FLIGHT = 2048
"""A safety cap on open streams, far above what a benchmark should reach."""

Schedule = Sequence[tuple[float, Request]]
"""(arrival time in seconds from the start, request), in arrival order."""


@dataclass(frozen=True)
class RunResult:
    records: list[RequestRecord]
    """One per request, in schedule order."""
    duration_s: float
    """From the first arrival to the last completion."""


async def _send(
    target: Target, request: Request, arrival: float, cap: asyncio.Semaphore
) -> RequestRecord:
    async with cap:
        try:
            record = await target.generate(request.prompt_text, request.output_len)
        except Exception as exc:  # a failed request is a data point, not a crash
            record = RequestRecord(start=arrival, end=time.perf_counter(), error=repr(exc))
    # Open loop: latency counts from the scheduled arrival, including any wait for the cap.
    record.start = min(record.start, arrival)
    return record


async def _send_after(
    target: Target, request: Request, previous: asyncio.Task[RequestRecord], cap: asyncio.Semaphore
) -> RequestRecord:
    """A session's next turn: ``think_s`` after its previous turn ended, however that ended."""
    await asyncio.wait([previous])
    await asyncio.sleep(request.think_s)
    return await _send(target, request, time.perf_counter(), cap)


async def run_schedule(
    target: Target,
    schedule: Schedule,
    *,
    max_in_flight: int = MAX_IN_FLIGHT,
    progress: bool = True,
    desc: str = "",
) -> RunResult:
    """Launch each request as a task at its arrival time (a session's later turn: once the turn
    it follows ended, which comes earlier in ``schedule``); wait for all of them."""
    cap = asyncio.Semaphore(max_in_flight)
    bar = tqdm(total=len(schedule), desc=desc or target.name, disable=not progress, leave=False)
    tasks: list[asyncio.Task[RequestRecord]] = []
    t0 = time.perf_counter()
    for offset, request in schedule:
        if request.follows is not None:
            previous = tasks[request.follows]
            task = asyncio.create_task(_send_after(target, request, previous, cap))
            task.add_done_callback(lambda _: bar.update())
            tasks.append(task)
            continue
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(_send(target, request, t0 + offset, cap))
        task.add_done_callback(lambda _: bar.update())
        tasks.append(task)
    try:
        records = list(await asyncio.gather(*tasks))
    finally:
        bar.close()
    return RunResult(records, max((r.end for r in records), default=t0) - t0)
