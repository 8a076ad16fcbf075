"""glibc heap settings for a serving process, so that its RSS follows what it holds.

glibc serves an allocation above the mmap threshold with its own mapping, returned to the kernel
on free, and raises that threshold (up to 32 MiB) each time such a mapping is freed. A process
that runs prefill sees activations of every size up to tens of MiB: after the first long prompt
they all come from the heap, where prompts of other lengths leave holes that the kernel never
gets back, and RSS drifts with the mix of lengths served. Fixing the threshold (which also turns
the adjustment off) keeps large, short-lived tensors in mappings; small ones, such as the
per-step tensors of decode, stay on the heap.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 20
TRIM_THRESHOLD = 4 << 20

log = logging.getLogger(__name__)


def fix_heap_thresholds(
    mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD
) -> bool:
    """Set glibc's mmap and trim thresholds for this process; False where libc is not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(M_TRIM_THRESHOLD, trim_threshold)
    )
    if not ok:
        log.warning("mallopt refused the heap thresholds; RSS may drift with prompt lengths")
    return ok
