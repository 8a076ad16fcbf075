"""Prefill lends its cores to decode while it has no prompt to compute.

On a CPU split 1 + 1, decode is bound by one core's memory read rate while the prefill core sits
idle between prompt passes for much of the time (docs/bench/HISTORY.md, "tenth run").
With a core lock, the decode instance steps with extra threads on the prefill cores whenever a
step starts while prefill is idle, and with its own threads only otherwise. Prefill, before a
pass, claims its cores and waits for the one borrowed step in flight to end, so a prompt pass
never shares its cores and a decode step never waits for a prompt pass.

Two ``flock(2)`` locks on files beside each other (the processes share nothing else):

- ``<path>.claim``: prefill holds it from the moment it wants its cores until its pass is done,
  so decode does not start a borrowed step in that window;
- ``<path>.cores``: held by whoever computes on the lent cores (prefill's pass, or one borrowed
  decode step).

The kernel drops a dead process's locks, so a crash on either side frees the cores.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

from splitserve.serving.guard import PayoffGuard
from splitserve.serving.lent_team import LentTeam, check_usable, claimed, try_lock
from splitserve.serving.omp_team import ThreadTeam, TorchTeam


class CoreLock:
    """One side's handle on the two lock files at ``path``; opened (created) once."""

    def __init__(self, path: str) -> None:
        if not path:
            raise ValueError("core_lock: a path is needed")
        self._claim = os.open(f"{path}.claim", os.O_RDWR | os.O_CREAT, 0o600)
        self._cores = os.open(f"{path}.cores", os.O_RDWR | os.O_CREAT, 0o600)

    def lend(self) -> AbstractContextManager[None]:
        """Prefill's side: hold the cores for one pass, after the borrowed step in flight."""
        return claimed(self._claim, self._cores)

    def try_borrow(self) -> bool:
        """Decode's side: take the cores if prefill neither computes nor wants them; never
        waits. A True must be matched by ``give_back``."""
        if not try_lock(self._claim):
            return False
        fcntl.flock(self._claim, fcntl.LOCK_UN)
        return try_lock(self._cores)

    def give_back(self) -> None:
        fcntl.flock(self._cores, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self._claim)
        os.close(self._cores)


class Borrower:
    """Runs each decode step on its own threads, or with one more per lent core when the lent
    cores are free at the step's start and borrowing pays (``guard``); counts both kinds.

    The engine thread stays on its own cores; the workers that borrowed steps add are made on
    the lent cores (``omp_team``), once, before the first borrowed step. With more than one own
    core every own-core step shrinks the team and ends those workers, so each borrowed step
    makes them anew there. Only steps that found the lent cores free feed the guard, with and
    without borrowing alike, so that both are timed while prefill is idle."""

    def __init__(
        self,
        lock: CoreLock,
        own: set[int],
        lent: set[int],
        team: ThreadTeam,
        guard: PayoffGuard | None = None,
    ) -> None:
        self.lock = lock
        self.widen = LentTeam(team, own, lent)
        self.guard = guard or PayoffGuard("borrowing prefill's cores")
        self.borrowed_steps = 0
        self._own_team_made = len(own) == 1

    @property
    def own(self) -> set[int]:
        return self.widen.own

    @property
    def lent(self) -> set[int]:
        return self.widen.lent

    @contextmanager
    def step(self, size: int) -> Iterator[None]:
        """One engine step of ``size`` requests."""
        if not self._own_team_made:
            self.widen.team.grow(len(self.own), self.own, self.own)
            self._own_team_made = True
        if not self.lock.try_borrow():
            yield
            return
        if not self.guard.use(size):
            self.lock.give_back()
            start = time.perf_counter()
            yield
            self.guard.record(size, False, time.perf_counter() - start)
            return
        self.borrowed_steps += 1
        try:
            with self.widen.widened():
                start = time.perf_counter()
                yield
                self.guard.record(size, True, time.perf_counter() - start)
        finally:
            self.lock.give_back()


def borrower_for(path: str, own: set[int], lent: set[int], allowed: set[int]) -> Borrower:
    """The decode side of ``core_lock``, run by the engine thread (pinned to ``own``);
    ``allowed``: the cores this process may run on."""
    check_usable(own, lent, allowed)
    return Borrower(CoreLock(path), own, lent, TorchTeam())
