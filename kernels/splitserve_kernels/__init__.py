"""Kernels behind one signature each. Only the pure-torch references exist so far; GPU kernels
will be chosen here per call for CUDA tensors."""

from splitserve_kernels.reference.attention import (
    gather_kv,
    paged_decode_attention,
    varlen_prefill_attention,
    write_kv,
)

__all__ = ["gather_kv", "paged_decode_attention", "varlen_prefill_attention", "write_kv"]
