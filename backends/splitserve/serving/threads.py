"""Which thread builds an engine that another thread runs.

libgomp keeps a team's idle workers spinning only while the process's OpenMP threads fit on its
cores. Every thread that ever ran a parallel torch op owns a team for as long as it lives, so a
model built on Triton's thread and stepped on the engine loop's holds two teams: the workers
then sleep between ops and every op pays a wake-up (docs/bench/HISTORY.md, "Engines built on a
thread of their own"). Building on a thread that has exited by the time the loop starts leaves
the loop's team the only one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def on_own_thread(fn: Callable[[], T], name: str = "build") -> T:
    """``fn()`` run on a new thread, which (and whose OpenMP team) is gone when this returns;
    its exception is raised here."""
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # handed to the caller, whatever it is
            error.append(exc)

    thread = threading.Thread(target=target, name=name)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
