"""Giving the heap's free pages back to the kernel, so that a stub's RSS follows what it holds.

glibc serves an allocation above the mmap threshold with its own mapping and raises that
threshold (up to 32 MiB) each time such a mapping is freed. A process that runs prefill sees
activations of every size up to tens of MiB: after the first long prompt they all come from the
heap, where prompts of other lengths leave free holes that glibc keeps, and RSS drifts with the
mix of lengths served. Fixing the threshold low keeps RSS flat but makes every large tensor a
fresh mapping whose pages fault in again, which slowed long prompt passes (docs/reliability.md).
Instead, the heap is left as it is and, at most every
``interval_s``, ``malloc_trim`` returns the free pages of every arena to the kernel; the next
allocations that reuse them fault them in once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable

TRIM_INTERVAL_S = 5.0


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    fn = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if fn is not None:
        fn.argtypes = (ctypes.c_size_t,)
        fn.restype = ctypes.c_int
    return fn


class HeapTrimmer:
    """``maybe_trim()`` from a loop: trims when ``interval_s`` has passed since the last trim.
    Does nothing where libc has no ``malloc_trim`` (not glibc)."""

    def __init__(self, interval_s: float = TRIM_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._trim = _malloc_trim()
        self._last = time.monotonic()

    @property
    def available(self) -> bool:
        return self._trim is not None

    def maybe_trim(self) -> bool:
        now = time.monotonic()
        if self._trim is None or now - self._last < self.interval_s:
            return False
        self._last = now
        self._trim(0)
        return True
