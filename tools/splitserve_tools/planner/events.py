"""The clock and event queue of the simulation, and the state of one simulated request."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(eq=False)
class SimRequest:
    idx: int
    arrival: float
    input_len: int
    output_len: int
    generated: int = 0
    """Tokens sampled so far (the first comes from the prompt pass)."""
    computed: int = 0
    """Tokens whose KV is in the pool of the engine that holds the request."""
    first: float = math.nan
    last: float = math.nan
    epoch: int = 0
    """Bumped when the request is preempted, so stale completion entries are skipped."""
    join_step: int = 0
    release: Callable[[], None] | None = field(default=None, repr=False)
    """Frees the request's KV on the prefill instance once decode has pulled it."""

    @property
    def num_tokens(self) -> int:
        return self.input_len + self.generated

    @property
    def done(self) -> bool:
        return self.generated >= self.output_len

    def emit(self, now: float) -> None:
        self.generated += 1
        if math.isnan(self.first):
            self.first = now
        if self.done:
            self.last = now


class Clock:
    """Runs callbacks in time order; ties run in the order they were scheduled."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0

    def at(self, time: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(time, self.now), self._seq, fn))
        self._seq += 1

    def run(self) -> None:
        while self._heap:
            self.now, _, fn = heapq.heappop(self._heap)
            fn()
