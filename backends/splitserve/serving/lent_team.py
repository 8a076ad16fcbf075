"""What both directions of core lending share: non-blocking flocks, and an OpenMP team that
widens onto lent cores for one step or pass (``serving.core_lend``, ``serving.decode_lend``)."""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager

from splitserve.serving.omp_team import ThreadTeam


def try_lock(fd: int) -> bool:
    """Take the exclusive flock on ``fd`` if nobody holds it; never waits."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@contextmanager
def claimed(claim: int, cores: int) -> Iterator[None]:
    """Hold the ``cores`` flock for one pass or step of the borrowing side, claiming first, so
    that the owner starts nothing more on them and its step or pass in flight is waited for."""
    fcntl.flock(claim, fcntl.LOCK_EX)
    try:
        fcntl.flock(cores, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(cores, fcntl.LOCK_UN)
    finally:
        fcntl.flock(claim, fcntl.LOCK_UN)


def check_usable(own: set[int], lent: set[int], allowed: set[int]) -> None:
    """ValueError unless this process (``allowed``) may run on both core sets."""
    if not (own | lent) <= allowed:
        raise ValueError(
            f"lent_cores {sorted(lent)} and cpu_cores {sorted(own)} must be among the cores "
            f"this process may use {sorted(allowed)}"
        )


class LentTeam:
    """The calling thread's team on its ``own`` cores, widened by one thread per ``lent`` core
    for one step or pass at a time. The lent workers are made on the lent cores (``grow``) the
    first time, and anew each time where there is more than one own core: a narrower region
    then ended them (``omp_team``)."""

    def __init__(self, team: ThreadTeam, own: set[int], lent: set[int]) -> None:
        if not own or not lent or own & lent:
            raise ValueError(
                f"own cores {sorted(own)} and lent cores {sorted(lent)} must be "
                "non-empty and disjoint"
            )
        self.team = team
        self.own = own
        self.lent = lent
        self._lent_made = False

    @contextmanager
    def widened(self) -> Iterator[None]:
        try:
            if len(self.own) > 1 or not self._lent_made:
                self.team.grow(len(self.own) + len(self.lent), self.lent, self.own)
                self._lent_made = True
            else:
                self.team.set_threads(len(self.own) + len(self.lent))
            yield
        finally:
            self.team.set_threads(len(self.own))
