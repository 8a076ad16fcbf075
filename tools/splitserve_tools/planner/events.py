"""The clock and event queue of the simulation, and the timeline of one simulated request."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(eq=False)
class SimRequest:
    """One request of the run: its lengths, and when its first and last tokens went out."""

    idx: int
    arrival: float
    input_len: int
    output_len: int
    first: float = math.nan
    last: float = math.nan

    def sent(self, now: float, finished: bool) -> None:
        """A token of this request went out at ``now``."""
        if math.isnan(self.first):
            self.first = now
        if finished:
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
