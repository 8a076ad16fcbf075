"""Decode lends its cores to prefill's passes while its streams have time to spare.

The other direction of ``serving.core_lend``. On a CPU split 1 + 1, a prefill core that cannot
keep up queues prompts for seconds (TTFT) while decode's steps run well inside their time per
token (BENCHMARKS.md, "Decode lends its cores to prefill"). Decode then offers its cores: a
prompt pass that starts while the offer stands waits for decode's step in flight, runs with one
more thread per lent core, and decode's next step waits for the pass. Decode offers while the
mean time between its steps over the last ``window_s`` stays under ``headroom`` of its target
time per output token (``LendPolicy``), and always while it has nothing to step; with the offer
it publishes its budget, the longest pass that keeps that mean under the bound, and a pass
borrows only if it expects to fit (from the time per token of earlier borrowed passes of its
size), so one long prompt cannot stall every stream for its whole pass.

Three ``flock(2)`` locks on files beside prefill's (the kernel drops a dead process's locks),
and the budget, one float64 in ``<path>.decode.budget`` (mapped by both):

- ``<path>.decode.offer``: held by decode while it offers its cores;
- ``<path>.decode.claim``: held by a borrowing pass from the moment it wants the cores until it
  ends, so decode starts no step in that window;
- ``<path>.decode.cores``: held by whoever computes on decode's cores (one decode step, or one
  borrowing pass).
"""

from __future__ import annotations

import fcntl
import math
import mmap
import os
import struct
import time
from collections import deque
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field

from splitserve.serving.guard import PayoffGuard
from splitserve.serving.lent_team import LentTeam, check_usable, claimed, try_lock
from splitserve.serving.omp_team import ThreadTeam, TorchTeam


class DecodeCores:
    """One side's handle on the three lock files of decode's cores at ``path``."""

    def __init__(self, path: str) -> None:
        if not path:
            raise ValueError("core_lock: a path is needed")
        flags = os.O_RDWR | os.O_CREAT
        self._offer = os.open(f"{path}.decode.offer", flags, 0o600)
        self._claim = os.open(f"{path}.decode.claim", flags, 0o600)
        self._cores = os.open(f"{path}.decode.cores", flags, 0o600)
        budget = os.open(f"{path}.decode.budget", flags, 0o600)
        try:
            os.ftruncate(budget, BUDGET.size)
            self._budget = mmap.mmap(budget, BUDGET.size)
        finally:
            os.close(budget)
        self._offering = False

    def offer(self, on: bool, budget_s: float = math.inf) -> None:
        """Decode's side: stand by (or withdraw) the offer of its cores, for passes of up to
        ``budget_s`` seconds."""
        if on:
            BUDGET.pack_into(self._budget, 0, budget_s)
        if on == self._offering:
            return
        fcntl.flock(self._offer, fcntl.LOCK_EX if on else fcntl.LOCK_UN)
        self._offering = on

    def budget(self) -> float:
        """Prefill's side: the longest pass decode lends its cores for now (0: no offer)."""
        return BUDGET.unpack_from(self._budget, 0)[0] if self.offered() else 0.0

    @property
    def offering(self) -> bool:
        return self._offering

    def hold(self) -> bool:
        """Decode's side: its cores for one step, after the borrowing pass in flight; whether
        it had to wait for one. Matched by ``release``."""
        waited = not try_lock(self._claim)
        if waited:
            fcntl.flock(self._claim, fcntl.LOCK_EX)
        try:
            if not try_lock(self._cores):
                waited = True
                fcntl.flock(self._cores, fcntl.LOCK_EX)
        finally:
            fcntl.flock(self._claim, fcntl.LOCK_UN)
        return waited

    def release(self) -> None:
        fcntl.flock(self._cores, fcntl.LOCK_UN)

    def offered(self) -> bool:
        """Prefill's side: whether decode offers its cores now."""
        try:
            fcntl.flock(self._offer, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(self._offer, fcntl.LOCK_UN)
        return False

    def borrow(self) -> AbstractContextManager[None]:
        """Prefill's side: decode's cores for one pass, after decode's step in flight."""
        return claimed(self._claim, self._cores)

    def close(self) -> None:
        self._budget.close()
        for fd in (self._offer, self._claim, self._cores):
            os.close(fd)


BUDGET = struct.Struct("d")


@dataclass
class LendPolicy:
    """Whether decode offers its cores: while idle, and while the mean time between its steps
    over the last ``window_s`` (what each running stream waits per token, a prompt pass on its
    cores included) is under ``headroom`` x ``tpot_target_s``. Fed by the engine thread."""

    tpot_target_s: float
    headroom: float = 0.8
    window_s: float = 2.0
    _ends: deque[float] = field(default_factory=deque)

    def __post_init__(self) -> None:
        if self.tpot_target_s <= 0 or not 0 < self.headroom <= 1 or self.window_s <= 0:
            raise ValueError("tpot_target_s, window_s must be positive, headroom in (0, 1]")

    def stepped(self, now: float) -> None:
        """A step that made a token for every running stream ended at ``now``."""
        self._ends.append(now)

    def idle(self) -> None:
        """Nothing is running: the next burst is measured afresh."""
        self._ends.clear()

    def _window(self, now: float) -> deque[float]:
        """The step ends within ``window_s`` of ``now`` (older ones dropped)."""
        ends = self._ends
        while ends and ends[0] < now - self.window_s:
            ends.popleft()
        return ends

    def mean_interval(self, now: float) -> float | None:
        """Mean seconds between the steps in the window, the open gap since the last one
        counted once it is the longer; None with fewer than two steps in it."""
        ends = self._window(now)
        if len(ends) < 2:
            return None
        closed = (ends[-1] - ends[0]) / (len(ends) - 1)
        return max(closed, (now - ends[0]) / len(ends))

    def offers(self, now: float) -> bool:
        interval = self.mean_interval(now)
        return interval is None or interval < self.headroom * self.tpot_target_s

    def budget(self, now: float) -> float:
        """The longest stall from ``now`` after which the window's mean step interval is still
        under the bound (the next step's own time, the closed mean, counted in)."""
        ends = self._window(now)
        if len(ends) < 2:
            return math.inf if not ends else max(0.0, self.bound - (now - ends[0]))
        closed = (ends[-1] - ends[0]) / (len(ends) - 1)
        return max(0.0, self.bound * len(ends) - (now - ends[0]) - closed)

    @property
    def bound(self) -> float:
        return self.headroom * self.tpot_target_s


class Lender:
    """Decode's engine-thread side: holds its cores around each step, and keeps the offer
    standing while ``policy`` allows."""

    def __init__(self, cores: DecodeCores, policy: LendPolicy) -> None:
        self.cores = cores
        self.policy = policy
        self.waited_steps = 0
        """Steps that waited for a prompt pass on the cores, and how long in all."""
        self.waited_s = 0.0

    def update(self, running: int) -> None:
        """After every turn of the engine loop, stepped or idle."""
        now = time.monotonic()
        if running == 0:
            self.policy.idle()
            self.cores.offer(True)
        else:
            self.cores.offer(self.policy.offers(now), self.policy.budget(now))

    @contextmanager
    def step(self) -> Iterator[None]:
        start = time.monotonic()
        if self.cores.hold():
            self.waited_steps += 1
            self.waited_s += time.monotonic() - start
        try:
            yield
        finally:
            self.cores.release()
        self.policy.stepped(time.monotonic())


POOLED_TOKENS = 512
"""Passes of this many tokens or more share one guard key (their time per token)."""


class PassBorrower:
    """Prefill's side: runs each prompt pass on its own threads, or with one more per lent core
    when decode offers its cores, the pass is expected to fit decode's budget, and borrowing
    pays (``guard``). Passes that found the offer standing feed the guard, with and without
    borrowing alike, their seconds per token keyed by size (passes of ``POOLED_TOKENS`` or more
    share one key: a long prompt is rare, and its time per token close to other long ones')."""

    def __init__(
        self,
        cores: DecodeCores,
        own: set[int],
        lent: set[int],
        team: ThreadTeam,
        guard: PayoffGuard | None = None,
    ) -> None:
        self.cores = cores
        self.widen = LentTeam(team, own, lent)
        self.guard = guard or PayoffGuard("borrowing decode's cores")
        self.borrowed_passes = 0
        self.over_budget = 0
        """Passes decode offered its cores to that were expected to outlast its budget."""

    @contextmanager
    def pass_(self, tokens: int) -> Iterator[None]:
        """One prompt pass over ``tokens`` tokens."""
        budget = self.cores.budget()
        key = min(tokens, POOLED_TOKENS)
        per_token = self.guard.median(key, True)
        if budget <= 0 or (per_token is not None and per_token * tokens > budget):
            if budget > 0:
                self.over_budget += 1
            yield
            return
        if not self.guard.use(key):
            start = time.perf_counter()
            yield
            self.guard.record(key, False, (time.perf_counter() - start) / tokens)
            return
        start = time.perf_counter()
        with self.cores.borrow(), self.widen.widened():
            self.borrowed_passes += 1
            yield
        self.guard.record(key, True, (time.perf_counter() - start) / tokens)


def pass_borrower_for(path: str, own: set[int], lent: set[int], allowed: set[int]) -> PassBorrower:
    """The prefill side of decode's lending, run by the thread that computes prompt passes
    (pinned to ``own``); ``allowed``: the cores this process may run on."""
    check_usable(own, lent, allowed)
    return PassBorrower(DecodeCores(path), own, lent, TorchTeam())
