"""Rotary position embedding (half-split convention, as Hugging Face Llama), in plain torch."""

from __future__ import annotations

from collections.abc import Callable

import torch

from splitserve_kernels.reference.attention import write_kv

Rotary = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by ``cos``/``sin`` ``[T, 1, head_dim]`` (each
    half of the last dim repeats the same frequencies)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotary_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    cache: torch.Tensor,
    layer: int,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
    rotary: Rotary = apply_rotary,
) -> torch.Tensor:
    """Rotates the queries and keys of a fused projection ``qkv`` ``[T, (heads + 2 * kv_heads) *
    head_dim]``, stores keys and values at their slots of ``layer`` (``write_kv``) and returns
    the queries ``[T, heads, head_dim]``. ``rotary`` rotates one tensor (``apply_rotary``'s
    signature; the dispatcher passes the GPU kernel)."""
    kv_heads, dim = cache.shape[-2:]
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q = rotary(q.view(-1, heads, dim), cos, sin)
    k = rotary(k.view(-1, kv_heads, dim), cos, sin)
    write_kv(cache, layer, k, v.view(-1, kv_heads, dim), slot_blocks, slot_offsets)
    return q
