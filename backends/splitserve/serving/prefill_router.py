"""Which prefill server gets the next prompt: pure routing state (no I/O, no clock of its own
beyond the one it is given), so that tests drive it with a fake clock.

- Least outstanding: the server with the fewest calls in flight wins; ties go round-robin in
  name order, so an idle fleet still spreads prompts and the choice is deterministic.
- Prefix affinity, within a load bound: a prompt goes to the server that was sent the longest
  run of its leading blocks lately (``PrefixAffinity``: where its prefix is probably cached), as
  long as that server has at most ``affinity_slack`` more calls in flight than the least loaded
  one; otherwise, and with no match anywhere, least outstanding decides. A prefill server
  batches several prompts per pass, so a call or two more in its queue costs at most part of
  a pass, while a hit saves computing the matched prefix; beyond the bound, load wins (a shared
  system prompt must not pile every call onto one server).
- Failures: ``mark_failed`` takes a server out of rotation for a backoff that doubles per
  consecutive failure (1 s, 2 s, ... up to 30 s); ``mark_ok`` (a success or an answered health
  probe) resets it. Once its backoff ends a server is back in rotation on probation: its next
  failure doubles the backoff again.
- All out of rotation: ``pick`` still returns the one whose backoff ends soonest rather than
  nothing, so a request tries (and may find the server back) instead of failing at once while
  the fleet restarts; the caller's failover and retry bound what that costs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from splitserve.serving.prefix_affinity import PrefixAffinity

BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
AFFINITY_SLACK = 2
"""Calls in flight beyond the least loaded server's that prefix affinity may add."""


@dataclass
class _Health:
    failures: int = 0
    """Consecutive failures; 0: healthy."""
    down_until: float = 0.0
    """Out of rotation until then (clock time)."""


class PrefillRouter:
    def __init__(
        self,
        servers: Iterable[str] = (),
        *,
        backoff_start_s: float = BACKOFF_START_S,
        backoff_max_s: float = BACKOFF_MAX_S,
        clock: Callable[[], float] = time.monotonic,
        affinity: PrefixAffinity | None = None,
        affinity_slack: int | None = AFFINITY_SLACK,
    ) -> None:
        self.backoff_start_s = backoff_start_s
        self.backoff_max_s = backoff_max_s
        self.clock = clock
        self.affinity = affinity if affinity is not None else PrefixAffinity()
        self.affinity_slack = affinity_slack
        """None: no prefix affinity (least outstanding alone)."""
        self.routed_by_prefix = 0
        """Picks that prefix affinity decided (a match within the load bound)."""
        self._health: dict[str, _Health] = {}
        """The servers discovery currently names."""
        self._outstanding: dict[str, int] = {}
        """Calls in flight per server, also of servers dropped since (until their calls end)."""
        self._last = ""
        """The latest pick: ties go to the next name after it."""
        self.update(set(servers))

    @property
    def servers(self) -> set[str]:
        return set(self._health)

    def update(self, servers: set[str]) -> None:
        """Discovery's current set: new servers join healthy, missing ones leave (their calls in
        flight still count until they end)."""
        for gone in set(self._health) - servers:
            del self._health[gone]
            self.affinity.forget(gone)
        for new in servers - set(self._health):
            self._health[new] = _Health()

    def pick(
        self,
        exclude: Iterable[str] = (),
        now: float | None = None,
        prefix: Sequence[bytes] = (),
    ) -> str | None:
        """The server for the next call, never one of ``exclude``; None if there is none.

        Among servers in rotation: the longest match of ``prefix`` (the prompt's block hashes,
        ``affinity.hashes``) within the load bound, else fewest outstanding, ties round-robin
        by name. With none in rotation: the one whose backoff ends soonest (see the module
        docstring). The pick is recorded as where the prompt's blocks now are."""
        now = self.clock() if now is None else now
        skip = set(exclude)
        candidates = sorted(s for s in self._health if s not in skip)
        if not candidates:
            return None
        up = [s for s in candidates if self._health[s].down_until <= now]
        if not up:
            choice = min(candidates, key=lambda s: (self._health[s].down_until, s))
            self.affinity.routed(choice, prefix)
            return choice
        fewest = min(self.outstanding(s) for s in up)
        matches: dict[str, int] = {}
        if self.affinity_slack is not None:
            bound = fewest + self.affinity_slack
            within = [s for s in up if self.outstanding(s) <= bound]
            matches = {s: self.affinity.matched(s, prefix) for s in within}
        best = max(matches.values(), default=0)
        if best:
            # The longest match; among equal matches the least loaded, then by name.
            choice = min((s for s, m in matches.items() if m == best), key=self._load_order)
            self.routed_by_prefix += 1
        else:
            tied = [s for s in up if self.outstanding(s) == fewest]
            choice = next((s for s in tied if s > self._last), tied[0])
            self._last = choice
        self.affinity.routed(choice, prefix)
        return choice

    def _load_order(self, server: str) -> tuple[int, str]:
        return self.outstanding(server), server

    def begin(self, server: str) -> None:
        """A call to ``server`` starts."""
        self._outstanding[server] = self._outstanding.get(server, 0) + 1

    def end(self, server: str) -> None:
        """A call to ``server`` ended, however it went."""
        left = self._outstanding.get(server, 0) - 1
        if left > 0:
            self._outstanding[server] = left
        else:
            self._outstanding.pop(server, None)

    def outstanding(self, server: str) -> int:
        return self._outstanding.get(server, 0)

    def mark_failed(self, server: str, now: float | None = None) -> float:
        """Take ``server`` out of rotation (it did not answer); returns its backoff in seconds.
        A server discovery no longer names is ignored (0.0)."""
        health = self._health.get(server)
        if health is None:
            return 0.0
        now = self.clock() if now is None else now
        # The exponent is capped: the backoff hit its maximum long before, and floats overflow.
        backoff = min(self.backoff_start_s * 2 ** min(health.failures, 32), self.backoff_max_s)
        health.failures += 1
        health.down_until = now + backoff
        self.affinity.forget(server)  # back after a restart, its cache is empty
        return backoff

    def mark_ok(self, server: str) -> None:
        """``server`` answered: back in rotation, its backoff reset."""
        health = self._health.get(server)
        if health is not None:
            health.failures = 0
            health.down_until = 0.0

    def is_up(self, server: str, now: float | None = None) -> bool:
        """Whether ``server`` is known and in rotation."""
        health = self._health.get(server)
        now = self.clock() if now is None else now
        return health is not None and health.down_until <= now

    def down(self, now: float | None = None) -> list[str]:
        """Servers out of rotation now, by name (what health probes look at)."""
        now = self.clock() if now is None else now
        return sorted(s for s, h in self._health.items() if h.down_until > now)

    def counts(self, now: float | None = None) -> dict[str, int]:
        """Per-state counts for stats: servers known, up, down; calls outstanding. Safe to call
        from another thread (the metrics one): it reads copies, each taken in one C call."""
        now = self.clock() if now is None else now
        health = list(self._health.values())
        down = sum(h.down_until > now for h in health)
        return {
            "servers": len(health),
            "servers_up": len(health) - down,
            "servers_down": down,
            "outstanding": sum(list(self._outstanding.values())),
            "routed_by_prefix": self.routed_by_prefix,
        }
