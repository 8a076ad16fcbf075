"""The heap trimmer: free pages inside glibc's heap go back to the kernel, at most once per
interval."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from splitserve.serving.heap import HeapTrimmer

glibc_only = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)

PROBE = """
import ctypes, ctypes.util, sys
from splitserve.serving.heap import HeapTrimmer

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

libc.free(libc.malloc(16 << 20))  # glibc now serves blocks up to 16 MiB from the heap
blocks = [libc.malloc(2 << 20) for _ in range(64)]
for b in blocks:
    ctypes.memset(b, 1, 2 << 20)
for b in blocks[:-1:2]:  # holes: the heap's top stays in use, so glibc keeps them
    libc.free(b)
before = rss_mib()
trimmer = HeapTrimmer(interval_s=0.0)
if sys.argv[1] == "trim":
    assert trimmer.maybe_trim()
print(before - rss_mib())
"""


def released_mib(mode: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    )
    return float(out.stdout)


@glibc_only
def test_free_holes_stay_resident_without_a_trim() -> None:
    assert released_mib("keep") < 4


@glibc_only
def test_trim_returns_the_holes() -> None:
    assert released_mib("trim") > 48  # 32 holes of 2 MiB


@glibc_only
def test_trims_at_most_once_per_interval() -> None:
    trimmer = HeapTrimmer(interval_s=3600.0)
    assert trimmer.available
    assert not trimmer.maybe_trim()
    trimmer.interval_s = 0.0
    assert trimmer.maybe_trim()
