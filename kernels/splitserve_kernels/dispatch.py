"""One entry per op: the OpenAI Triton kernel for CUDA tensors, the C++ kernel of ``cpu/`` for CPU
tensors where one exists, the pure-torch reference elsewhere (no ``triton`` installed, a CPU
kernel that did not build, or ``SPLITSERVE_KERNELS=reference``)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from types import ModuleType

import torch

from splitserve_kernels import cpu
from splitserve_kernels.reference import activation, attention, fp8, norm, rope, sampling

FORCE_ENV = "SPLITSERVE_KERNELS"
"""``reference`` makes every op use its reference, also on CUDA (for A/B checks)."""


@functools.cache
def triton_available() -> bool:
    return (
        os.environ.get(FORCE_ENV) != "reference" and importlib.util.find_spec("triton") is not None
    )


@functools.cache
def _gpu(name: str) -> ModuleType:
    return importlib.import_module(f"splitserve_kernels.gpu.{name}")


def uses_kernel(t: torch.Tensor) -> bool:
    """Whether ops on ``t`` run the Triton kernel rather than the reference."""
    return t.is_cuda and triton_available()


def paged_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    impl = _gpu("attention") if uses_kernel(q) else cpu if cpu.usable(q) else attention
    return impl.paged_decode_attention(
        q, cache, layer, block_tables, seq_lens, scale, sliding_window
    )


def paged_prefill_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    layer: int,
    block_tables: list[torch.Tensor],
    cu_seqlens_q: list[int],
    cu_seqlens_k: list[int],
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of a prefill batch's new tokens ``q`` ``[T, heads, d]`` over each
    sequence's keys in the cache (see ``reference.attention.paged_prefill_attention``). The C++
    kernel on CPUs; the reference (a gather, then torch's attention) elsewhere."""
    fits = cpu.usable(q) and cache.is_contiguous() and q.shape[-1] in cpu.PREFILL_HEAD_DIMS
    return (cpu if fits else attention).paged_prefill_attention(
        q, cache, layer, block_tables, cu_seqlens_q, cu_seqlens_k, scale, sliding_window
    )


def prepare(device: torch.device | str) -> None:
    """Build or load the kernels a model on ``device`` calls, before its first request."""
    if torch.device(device).type == "cpu":
        cpu.extension()


def _norm(x: torch.Tensor) -> ModuleType:
    return _gpu("norm") if uses_kernel(x) else cpu if cpu.usable(x) else norm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x).rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm(x).add_rms_norm(x, residual, weight, eps)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return (_gpu("rope") if uses_kernel(x) else rope).apply_rotary(x, cos, sin)


def rotary_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    cache: torch.Tensor,
    layer: int,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> torch.Tensor:
    """Rotated queries ``[T, heads, head_dim]`` of a fused ``qkv``; keys and values go to their
    cache slots (see ``reference.rope.rotary_write_kv``)."""
    args = (qkv, cos, sin, heads, cache, layer, slot_blocks, slot_offsets)
    if cpu.usable(qkv) and cache.is_contiguous():
        return cpu.rotary_write_kv(*args)
    return rope.rotary_write_kv(*args, rotary=apply_rotary)


def silu_mul_(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` into ``gate``."""
    fused = cpu.usable(gate) and gate.is_contiguous() and up.is_contiguous()
    return (cpu if fused else activation).silu_mul_(gate, up)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest logit, the first where several tie (long ``[batch]``)."""
    return (cpu if cpu.usable(logits) else sampling).greedy_tokens(logits)


def _fp8(pool: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> ModuleType:
    if uses_kernel(pool):
        return _gpu("fp8")
    contiguous = pool.is_contiguous() and q.is_contiguous() and scales.is_contiguous()
    return cpu if cpu.usable(pool) and contiguous else fp8


def fp8_encode_blocks(
    pool: torch.Tensor,
    src_ids: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    dst_ids: torch.Tensor,
) -> None:
    """Blocks ``src_ids`` of a KV pool as e4m3 bytes and per-head scales into blocks ``dst_ids``
    of ``q``/``scales`` (see ``reference.fp8``)."""
    _fp8(pool, q, scales).encode_blocks(pool, src_ids, q, scales, dst_ids)


def fp8_decode_blocks(
    q: torch.Tensor,
    scales: torch.Tensor,
    src_ids: torch.Tensor,
    pool: torch.Tensor,
    dst_ids: torch.Tensor,
) -> None:
    """The inverse: blocks ``src_ids`` of ``q``/``scales`` into blocks ``dst_ids`` of a pool."""
    _fp8(pool, q, scales).decode_blocks(q, scales, src_ids, pool, dst_ids)
