"""Light load: a few requests in flight at a time, the targets taking turns on each group of
prompts, so that every target meets the machine in the same state (caches, other processes,
clock) and runs the same small batches."""

from __future__ import annotations

import asyncio
import math
import os
import statistics
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from splitserve.serving.affinity import pin_process_threads
from splitserve_client.stream import RequestRecord
from splitserve_tools.bench.target import Target


@contextmanager
def client_on(cores: set[int] | None) -> Iterator[None]:
    """This process's threads, and those they make, on ``cores`` for the block (None: where
    they are). A client on the server's machine belongs where the server's own threads run:
    on decode's one core it takes turns with the engine (BENCHMARKS.md, "Light load: where the
    client runs")."""
    if cores is None:
        yield
        return
    allowed = os.sched_getaffinity(0)
    pin_process_threads(os.getpid(), cores)
    try:
        yield
    finally:
        pin_process_threads(os.getpid(), allowed)


def groups(prompts: Sequence[str], sizes: Sequence[int]) -> list[list[str]]:
    """``prompts`` cut into consecutive groups of ``sizes[0]``, ``sizes[1]``, ... (cycling)."""
    out: list[list[str]] = []
    i = 0
    while i < len(prompts):
        size = sizes[len(out) % len(sizes)]
        out.append(list(prompts[i : i + size]))
        i += size
    return out


async def take_turns(
    targets: Sequence[Target], prompt_groups: Sequence[Sequence[str]], max_tokens: int
) -> dict[str, list[RequestRecord]]:
    """Each group to every target in turn (the order reversed on every other group), the
    prompts of a group sent at once; the records per target name, in prompt order."""
    records: dict[str, list[RequestRecord]] = {t.name: [] for t in targets}
    for i, group in enumerate(prompt_groups):
        for target in targets if i % 2 == 0 else reversed(targets):
            sent = [target.generate(prompt, max_tokens) for prompt in group]
            records[target.name] += await asyncio.gather(*sent)
    return records


def median_tpot(records: Sequence[RequestRecord]) -> float:
    """TPOT p50 of the records; raises if any failed."""
    failed = [r.error for r in records if r.error]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")
    values = [r.tpot for r in records if not math.isnan(r.tpot)]
    if not values:
        raise RuntimeError("no request produced two tokens")
    return statistics.median(values)
