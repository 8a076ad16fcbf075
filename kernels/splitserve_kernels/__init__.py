"""Kernels behind one signature each, chosen per call by the tensors' device.

CPU tensors use the C++ kernels of ``splitserve_kernels.cpu`` where they built, else the pure-torch
references in ``splitserve_kernels.reference``.
"""

import torch

from splitserve_kernels.cpu import extension as _cpu_extension
from splitserve_kernels.cpu import paged_decode_attention
from splitserve_kernels.reference.attention import (
    gather_kv,
    varlen_prefill_attention,
    write_kv,
)


def prepare(device: torch.device | str) -> None:
    """Build or load the kernels a model on ``device`` will call, before the first request."""
    if torch.device(device).type == "cpu":
        _cpu_extension()


__all__ = [
    "gather_kv",
    "paged_decode_attention",
    "prepare",
    "varlen_prefill_attention",
    "write_kv",
]
