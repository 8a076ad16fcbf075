"""Paged decode attention: one query token per sequence against its layer-major KV cache.

One program per (sequence, KV head, split): the query heads of that KV head's group are the
rows of one ``tl.dot`` tile (GQA reads each K/V tile once for the whole group), keys stream in
tiles of ``TILE`` tokens gathered through the block table, with an online softmax in base 2.
Short batches split every sequence's keys into several ranges (flash-decoding), whose partial
outputs and log-sum-exps are merged afterwards, so that the GPU has enough programs.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
TILE = 32
"""Keys per inner step; at least 16 (``tl.dot``), any block size works with it."""


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    cache_ptr,
    tables_ptr,
    lens_ptr,
    out_ptr,
    lse_ptr,
    layer,
    scale_log2,
    window,
    tiles_per_split,
    stride_qb,
    stride_qh,
    stride_cb,
    stride_cl,
    stride_ckv,
    stride_ct,
    stride_ch,
    stride_tb,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(seq_len - window, 0)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    t = tl.arange(0, TILE)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    tile_lo = tl.maximum(split * tiles_per_split, start // TILE)
    tile_hi = tl.minimum((split + 1) * tiles_per_split, tl.cdiv(seq_len, TILE))
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    layer_base = cache_ptr + layer * stride_cl + kvh * stride_ch
    for tile in range(tile_lo, tile_hi):
        pos = tile * TILE + t
        valid = (pos < seq_len) & (pos >= start)
        block = tl.load(tables_ptr + b * stride_tb + pos // BLOCK_SIZE, mask=valid, other=0)
        rows = layer_base + block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_ct
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(rows[:, None] + stride_ckv + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    nonempty = l_sum > 0
    out = acc / tl.where(nonempty, l_sum, 1.0)[:, None]
    lse = tl.where(nonempty, m + tl.log2(tl.where(nonempty, l_sum, 1.0)), float("-inf"))
    tl.store(
        out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :],
        out,
        mask=g_mask[:, None] & d_mask[None, :],
    )
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _default_splits(q: torch.Tensor, kv_heads: int, max_tiles: int) -> int:
    if not q.is_cuda:
        return 1
    programs = q.shape[0] * kv_heads
    target = 2 * _num_sms(q.device.index or 0)
    return max(1, min(max_tiles, -(-target // programs), 16))


def paged_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Same contract as ``reference.attention.paged_decode_attention``; ``num_splits`` fixes
    how many key ranges each sequence is split into (default: enough programs for the GPU)."""
    batch, heads, dim = q.shape
    _, _, _, block_size, kv_heads, cache_dim = cache.shape
    if cache_dim != dim or heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(cache.shape)}")
    if cache.stride(-1) != 1:
        raise ValueError("the KV cache's last dim must be contiguous")
    q = q if q.stride(-1) == 1 else q.contiguous()
    group = heads // kv_heads
    max_tiles = triton.cdiv(block_tables.shape[1] * block_size, TILE)
    splits = num_splits or _default_splits(q, kv_heads, max_tiles)
    tiles_per_split = triton.cdiv(max_tiles, splits)
    out = torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(batch, kv_heads, splits)](
        q,
        cache,
        block_tables,
        seq_lens,
        out,
        lse,
        layer,
        scale * LOG2E,
        sliding_window or 0,
        tiles_per_split,
        q.stride(0),
        q.stride(1),
        cache.stride(1),
        cache.stride(0),
        cache.stride(2),
        cache.stride(3),
        cache.stride(4),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        lse.stride(0),
        lse.stride(1),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=dim,
        DIM_PAD=max(16, triton.next_power_of_2(dim)),
        BLOCK_SIZE=block_size,
        TILE=TILE,
        HAS_WINDOW=sliding_window is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    if splits == 1:
        return out[:, :, 0].to(q.dtype)
    weights = torch.softmax(lse * math.log(2.0), dim=-1)
    return (out * weights[..., None]).sum(2).to(q.dtype)
