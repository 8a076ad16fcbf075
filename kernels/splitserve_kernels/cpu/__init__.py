"""C++ kernels for CPUs, compiled on first use with the local compiler.

The build (about 20 s on two cores) is cached by torch under ``$TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``) and reused by every later process; a source change rebuilds it.
``SPLITSERVE_KERNELS=reference`` turns them off. Where the build fails, ``extension()`` is None
(with one warning) and the dispatcher uses the pure-torch references instead.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_SOURCES = [_HERE / name for name in ("module.cpp", "paged_attention.cpp")]
_HEADERS = [_HERE / "vec.h"]
_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp"]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""What the kernels take; other dtypes use the references."""


def enabled() -> bool:
    return os.environ.get("SPLITSERVE_KERNELS") != "reference"


def _headers_digest() -> str:
    """Torch rebuilds when a source or a flag changes, not a header: the headers' digest goes
    into a flag."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in _HEADERS))
    return digest.hexdigest()[:16]


@functools.cache
def extension() -> ModuleType | None:
    """The compiled module, or None where kernels are off or the build failed."""
    if not enabled():
        return None
    from torch.utils.cpp_extension import load

    log.info("loading the CPU kernels (compiled once, then cached)")
    try:
        return load(
            "splitserve_cpu_kernels",
            [str(p) for p in _SOURCES],
            extra_cflags=[*_FLAGS, f"-DSPLITSERVE_HEADERS={_headers_digest()}"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as exc:  # a missing compiler or headers: run on the reference instead
        log.warning("CPU kernels unavailable, using the torch reference: %s", exc)
        return None


def paged_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Same contract as ``reference.attention.paged_decode_attention``, for CPU tensors; reads the
    cache in place. Only called where ``extension()`` built."""
    ext = extension()
    assert ext is not None
    return ext.paged_decode_attention(
        q, cache, layer, block_tables, seq_lens, scale, sliding_window or -1
    )
