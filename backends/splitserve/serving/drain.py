"""Shutdown drain: how a launcher tells the model instances that the server is about to stop.

Triton finalizes a decoupled model only after every response sender of it is gone, so streams
still running when tritonserver gets SIGTERM would keep it from stopping until its exit timeout
kills it. The launcher names a file in ``SPLITSERVE_DRAIN_FILE`` at start and creates it just
before SIGTERM; each generate instance then ends its requests with UNAVAILABLE and refuses new
ones, and the server stops cleanly. Any supervisor can do the same (a Kubernetes preStop hook).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

DRAIN_ENV = "SPLITSERVE_DRAIN_FILE"
MESSAGE = "server is shutting down; retry on another replica"


class DrainWatch:
    """Whether the drain file exists, looked up at most every ``interval_s``."""

    def __init__(self, environ: Mapping[str, str] | None = None, interval_s: float = 0.05) -> None:
        env = os.environ if environ is None else environ
        self.path = env.get(DRAIN_ENV) or None
        self.interval_s = interval_s
        self._next = 0.0
        self._requested = False

    def requested(self) -> bool:
        if self._requested or self.path is None:
            return self._requested
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.interval_s
            self._requested = os.path.exists(self.path)
        return self._requested
