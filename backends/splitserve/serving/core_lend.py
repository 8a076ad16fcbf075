"""Prefill lends its cores to decode while it has no prompt to compute.

On a CPU split 1 + 1, decode is bound by one core's memory read rate while the prefill core sits
idle between prompt passes (about 60 % of the time at the chatbot goodput edge, BENCHMARKS.md).
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class CoreLock:
    """One side's handle on the two lock files at ``path``; opened (created) once."""

    def __init__(self, path: str) -> None:
        if not path:
            raise ValueError("core_lock: a path is needed")
        self._claim = os.open(f"{path}.claim", os.O_RDWR | os.O_CREAT, 0o600)
        self._cores = os.open(f"{path}.cores", os.O_RDWR | os.O_CREAT, 0o600)

    @contextmanager
    def lend(self) -> Iterator[None]:
        """Prefill's side: hold the cores for one pass, after the borrowed step in flight."""
        fcntl.flock(self._claim, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._cores, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._cores, fcntl.LOCK_UN)
        finally:
            fcntl.flock(self._claim, fcntl.LOCK_UN)

    def try_borrow(self) -> bool:
        """Decode's side: take the cores if prefill neither computes nor wants them; never
        waits. A True must be matched by ``give_back``."""
        if not _try_lock(self._claim):
            return False
        fcntl.flock(self._claim, fcntl.LOCK_UN)
        return _try_lock(self._cores)

    def give_back(self) -> None:
        fcntl.flock(self._cores, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self._claim)
        os.close(self._cores)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


class Borrower:
    """Runs each decode step on its own threads, or with one more per lent core when the lent
    cores are free at the step's start; counts the borrowed steps.

    The engine thread stays on its own cores. The first borrowed step creates the OpenMP team's
    extra workers, which inherit the engine thread's affinity at that moment: for that one step
    the engine thread moves to the lent cores, so the workers it creates never run on its own
    cores (where the scheduler otherwise often wakes them, beside the engine thread), and is
    pinned back after. With more than one own core, borrowing starts after a step on the own
    cores has created the team's workers for those (libgomp reuses a team's workers in the order
    it made them)."""

    def __init__(
        self,
        lock: CoreLock,
        own: set[int],
        lent: set[int],
        set_threads: Callable[[int], None],
        set_affinity: Callable[[set[int]], None],
    ) -> None:
        if not own or not lent or own & lent:
            raise ValueError(
                f"own cores {sorted(own)} and lent cores {sorted(lent)} must be "
                "non-empty and disjoint"
            )
        self.lock = lock
        self.own = own
        self.lent = lent
        self._set_threads = set_threads
        self._set_affinity = set_affinity
        self.borrowed_steps = 0
        self._own_team_made = len(own) == 1

    @contextmanager
    def step(self) -> Iterator[None]:
        if not self._own_team_made:
            self._own_team_made = True
            yield
            return
        if not self.lock.try_borrow():
            yield
            return
        first = self.borrowed_steps == 0
        self.borrowed_steps += 1
        try:
            if first:
                self._set_affinity(self.lent)
            self._set_threads(len(self.own) + len(self.lent))
            yield
        finally:
            self.lock.give_back()
            self._set_threads(len(self.own))
            if first:
                self._set_affinity(self.own)


def borrower_for(path: str, own: set[int], lent: set[int], allowed: set[int]) -> Borrower:
    """The decode side of ``core_lock``, run by the engine thread (pinned to ``own``);
    ``allowed``: the cores this process may run on."""
    import torch

    if not (own | lent) <= allowed:
        raise ValueError(
            f"lent_cores {sorted(lent)} and cpu_cores {sorted(own)} must be among the cores "
            f"this process may use {sorted(allowed)}"
        )
    return Borrower(
        CoreLock(path),
        own,
        lent,
        torch.set_num_threads,
        lambda cores: os.sched_setaffinity(0, cores),
    )
