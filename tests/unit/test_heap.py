"""The heap thresholds: large blocks stay in their own mappings after a larger one is freed."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)

PROBE = """
import ctypes, ctypes.util, sys
from splitserve.serving.heap import fix_heap_thresholds

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "fixed":
    assert fix_heap_thresholds()
libc.free(libc.malloc(16 << 20))  # glibc's default would now raise its threshold to 16 MiB
before = libc.mallinfo2().hblks
block = libc.malloc(2 << 20)
print(libc.mallinfo2().hblks - before)
libc.free(block)
"""


def mapped_after_large_free(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    )
    return int(out.stdout)


def test_default_glibc_keeps_the_block_on_the_heap() -> None:
    assert mapped_after_large_free("default") == 0


def test_fixed_threshold_maps_the_block() -> None:
    assert mapped_after_large_free("fixed") == 1
