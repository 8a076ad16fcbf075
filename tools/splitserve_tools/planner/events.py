"""The clock and event queue of the simulation, and the timeline of one simulated request."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from splitserve.engine.request import Request
from splitserve.engine.sampling_params import SamplingParams

TOKEN = 0
"""Every sampled token, and every prompt token of a request without ``prompt``: the scheduler
counts tokens, and only the prefix cache reads them."""

SIM_KEY = b"sim"
"""The layout key of the simulated pools' block hashes (``kv.block_hash``)."""


@dataclass(eq=False)
class SimRequest:
    """One request of the run: its lengths, and when its first and last tokens went out."""

    idx: int
    arrival: float
    """When it is sent; a later turn of a session: set when the turn it follows ends."""
    input_len: int
    output_len: int
    prompt: tuple[int, ...] | None = None
    """Token ids, where prompts share prefixes (a session workload's); None: a prompt of its
    own, which no prefix cache can serve."""
    follows: int | None = None
    """Index of the request this one is sent ``think_s`` after (its session's previous turn)."""
    think_s: float = 0.0
    on_finish: Callable[[float], None] | None = None
    """Called with the time its last token went out."""
    first: float = math.nan
    last: float = math.nan

    def sent(self, now: float, finished: bool) -> None:
        """A token of this request went out at ``now``."""
        if math.isnan(self.first):
            self.first = now
        if finished:
            self.last = now
            if self.on_finish is not None:
                self.on_finish(now)


@cache
def _params(output_len: int) -> SamplingParams:
    """Shared by every request of that length: nothing in the scheduler writes to them."""
    return SamplingParams(max_tokens=output_len, ignore_eos=True)


def engine_request(sim: SimRequest) -> Request:
    """The engine's request for ``sim``, as its scheduler and prefix cache see it."""
    prompt = list(sim.prompt) if sim.prompt is not None else [TOKEN] * sim.input_len
    return Request(str(sim.idx), prompt, _params(sim.output_len), seed=0, arrival=sim.arrival)


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
