"""``GET /health``: the Triton model's readiness as last seen by a check in the background.

A probe is answered from that state at once: it never waits on Triton, nor on the inference
streams (the check has a gRPC connection of its own, see ``app``). One slow or failed check
under load changes nothing: the state turns not ready only after ``FAILURES`` checks in a row
failed (Triton stopped, unreachable or hung, or its model unloaded), or as soon as the frontend
knows that it is shutting down. Until Triton is first seen ready, it is not ready.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0
CHECK_TIMEOUT_S = 5.0
"""Generous: a busy server may take long to answer; only a run of failures counts."""
FAILURES = 3

Probe = Callable[[], Awaitable[bool]]
"""One readiness question to Triton: True when its model is ready."""


class Readiness:
    def __init__(
        self,
        interval_s: float = CHECK_INTERVAL_S,
        timeout_s: float = CHECK_TIMEOUT_S,
        failures: int = FAILURES,
    ) -> None:
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.failures = failures
        self._seen_ready = False
        self._failed = 0
        self._shutting_down = False

    @property
    def ready(self) -> bool:
        return self._seen_ready and self._failed < self.failures and not self._shutting_down

    def shutting_down(self) -> None:
        """Not ready from now on (may be called from any thread)."""
        self._shutting_down = True

    async def check(self, probe: Probe) -> None:
        """Ask once; a probe that raises or takes over ``timeout_s`` counts as a failure."""
        was_ready = self.ready
        try:
            # Not asyncio.wait_for: on Python 3.11 it can swallow the cancel of a task whose
            # probe has just answered, and ``watch`` then never stops.
            async with asyncio.timeout(self.timeout_s):
                ok = await probe()
        except Exception as exc:  # any failure to answer (timeout, gRPC error) is "not ready"
            log.debug("readiness check failed: %r", exc)
            ok = False
        if ok:
            self._seen_ready, self._failed = True, 0
        else:
            self._failed += 1
        if self.ready and not was_ready:
            log.info("Triton's model is ready")
        elif was_ready and not self.ready and not self._shutting_down:
            log.warning("Triton's model failed %d readiness checks in a row", self._failed)

    async def watch(self, probe: Probe) -> None:
        """Check every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.check(probe)
