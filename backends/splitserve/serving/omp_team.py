"""Where the engine thread's OpenMP workers run.

torch computes on one OpenMP team per calling thread (libgomp). A worker is created by the first
parallel region that needs it and inherits the CPU affinity its creator has at that moment; a
region with more than one thread but fewer than the team has ends the surplus workers, and a
later, larger region creates them anew (``gomp_team_start``). Left to itself, then, a worker
runs wherever the engine thread happened to be when some op first asked for that many threads.
``grow`` decides it: it moves the engine thread to the target cores for one region that always
uses the whole team (an elementwise op longer than torch's grain size), then moves it back.
"""

from __future__ import annotations

import os
from typing import Protocol

FULL_REGION_ELEMENTS = 1 << 16
"""Elements of the fill that runs on every thread of the team: above torch's parallel grain
size (32768), below which an op runs on the calling thread alone."""


class ThreadTeam(Protocol):
    """The calling thread's OpenMP team."""

    def set_threads(self, n: int) -> None:
        """Threads the next parallel regions use (workers beyond them sit idle)."""

    def grow(self, n: int, cores: set[int], home: set[int]) -> None:
        """Use ``n`` threads; workers the team lacks are made on ``cores``; the calling thread
        ends on ``home``."""


class TorchTeam:
    """``ThreadTeam`` of torch's intra-op threads; call it from the thread that steps."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._buf = torch.empty(FULL_REGION_ELEMENTS)

    def set_threads(self, n: int) -> None:
        self._torch.set_num_threads(n)

    def grow(self, n: int, cores: set[int], home: set[int]) -> None:
        os.sched_setaffinity(0, cores)
        try:
            self._torch.set_num_threads(n)
            self._buf.fill_(0.0)
        finally:
            os.sched_setaffinity(0, home)
