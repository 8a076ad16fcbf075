"""FP8 (e4m3) transfer encoding of KV blocks, the pure-torch reference.

Blocks of a pool ``[layers, blocks, 2, block_size, kv_heads, head_dim]`` travel as e4m3 bytes of
the same shape (``uint8``, the bits of ``torch.float8_e4m3fn``) and one float32 scale per layer,
block, K/V and head (``[layers, blocks, 2, kv_heads]``): the head's largest magnitude in the block
maps to 448, e4m3's largest finite value. Encoding multiplies by ``448 / amax`` (an all-zero head
keeps a factor of 1 and a scale of 0); decoding multiplies the e4m3 value by the scale and rounds
to the pool's dtype. Both work in float32, so the kernels give the same bits. Non-finite KV is
not supported (it decodes as NaN).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
"""The largest finite e4m3 (``float8_e4m3fn``) value."""


def check_blocks(pool: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
    if pool.dim() != 6 or q.dim() != 6 or pool.shape[2:] != q.shape[2:]:
        raise ValueError(f"pool {tuple(pool.shape)} and wire {tuple(q.shape)} blocks differ")
    if q.dtype != torch.uint8 or scales.dtype != torch.float32:
        raise ValueError("wire blocks are uint8 (e4m3 bits), scales float32")
    if scales.shape != (q.shape[0], q.shape[1], 2, q.shape[4]):
        raise ValueError(f"scales {tuple(scales.shape)} do not fit wire blocks {tuple(q.shape)}")


def encode_blocks(
    pool: torch.Tensor,
    src_ids: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    dst_ids: torch.Tensor,
) -> None:
    """Encode blocks ``src_ids`` of ``pool`` into blocks ``dst_ids`` of ``q`` and ``scales``."""
    check_blocks(pool, q, scales)
    x = pool[:, src_ids].float()  # [L, n, 2, bs, H, D]
    amax = x.abs().amax(dim=(3, 5))  # [L, n, 2, H]
    zero = amax == 0
    # A true division (``448 / tensor`` would multiply by a reciprocal, another rounding).
    factor = torch.where(zero, torch.ones_like(amax), torch.full_like(amax, FP8_MAX) / amax)
    y = x * factor[:, :, :, None, :, None]
    q[:, dst_ids] = y.to(torch.float8_e4m3fn).view(torch.uint8)
    scales[:, dst_ids] = amax / FP8_MAX


def decode_blocks(
    q: torch.Tensor,
    scales: torch.Tensor,
    src_ids: torch.Tensor,
    pool: torch.Tensor,
    dst_ids: torch.Tensor,
) -> None:
    """Decode blocks ``src_ids`` of ``q``/``scales`` into blocks ``dst_ids`` of ``pool``."""
    check_blocks(pool, q, scales)
    x = q[:, src_ids].view(torch.float8_e4m3fn).float()
    s = scales[:, src_ids]
    pool[:, dst_ids] = (x * s[:, :, :, None, :, None]).to(pool.dtype)
