"""Kernels behind one signature each: an OpenAI Triton kernel (``gpu/``) chosen per call for
CUDA tensors, a C++ kernel (``cpu/``) for CPU tensors where one exists, the pure-torch reference
(``reference/``) everywhere else (see ``dispatch``). Prefill attention on CUDA and KV gathers
use the references. ``cpu_status()`` says whether the compiled CPU kernels or the
references run on CPUs (and why); ``python -m splitserve_kernels.build`` builds them ahead of
use."""

from splitserve_kernels.cpu import status as cpu_status
from splitserve_kernels.dispatch import (
    add_rms_norm,
    apply_rotary,
    fp8_decode_blocks,
    fp8_encode_blocks,
    greedy_tokens,
    paged_decode_attention,
    paged_prefill_attention,
    prepare,
    rms_norm,
    rotary_write_kv,
    silu_mul_,
    triton_available,
    uses_kernel,
)
from splitserve_kernels.reference.attention import gather_kv, varlen_prefill_attention, write_kv
from splitserve_kernels.reference.linear import pack_panels

__all__ = [
    "add_rms_norm",
    "apply_rotary",
    "cpu_status",
    "fp8_decode_blocks",
    "fp8_encode_blocks",
    "gather_kv",
    "greedy_tokens",
    "pack_panels",
    "paged_decode_attention",
    "paged_prefill_attention",
    "prepare",
    "rms_norm",
    "rotary_write_kv",
    "silu_mul_",
    "triton_available",
    "uses_kernel",
    "varlen_prefill_attention",
    "write_kv",
]
