"""FP8 (e4m3) transfer encoding of KV blocks on CUDA: one program per layer, block pair and K/V
(see ``reference.fp8``). The e4m3 conversions are done on the bits, as the CPU kernel does them:
the same rounding (to nearest even) on GPUs and in Triton's interpreter, whose float8 cast
truncates."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve_kernels.reference.fp8 import check_blocks


@triton.jit
def _to_e4m3(y):
    bits = y.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    sub = (a.to(tl.float32, bitcast=True) * 512.0 + 12582912.0).to(tl.uint32, bitcast=True)
    out = tl.where(a >= 0x3C800000, normal, sub - 0x4B400000)
    out = tl.where(a > 0x43F00000, 0x7F, out)
    return (out | sign).to(tl.uint8)


@triton.jit
def _from_e4m3(b):
    b = b.to(tl.uint32)
    exp = (b >> 3) & 15
    mant = b & 7
    normal = ((exp + 120) << 23 | mant << 20).to(tl.float32, bitcast=True)
    v = tl.where(exp == 0, mant.to(tl.float32) * 0.001953125, normal)
    v = tl.where((exp == 15) & (mant == 7), float("nan"), v)
    return tl.where((b & 0x80) != 0, -v, v)


@triton.jit
def _encode_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    src_ptr,
    dst_ptr,
    n,
    pool_blocks,
    wire_blocks,
    SLOT: tl.constexpr,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    item = tl.program_id(0).to(tl.int64)
    kv = item % 2
    i = item // 2 % n
    layer = item // 2 // n
    src = tl.load(src_ptr + i)
    dst = tl.load(dst_ptr + i)
    t = tl.arange(0, BLOCK_T)[:, None, None]
    h = tl.arange(0, BLOCK_H)[None, :, None]
    d = tl.arange(0, BLOCK_D)[None, None, :]
    mask = (t < SLOT // (HEADS * DIM)) & (h < HEADS) & (d < DIM)
    offs = (t * HEADS + h) * DIM + d
    x = tl.load(x_ptr + ((layer * pool_blocks + src) * 2 + kv) * SLOT + offs, mask=mask, other=0.0)
    x = x.to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=2), axis=0)  # [BLOCK_H]
    factor = tl.where(amax == 0.0, 1.0, tl.math.div_rn(448.0, amax))
    y = x * factor[None, :, None]
    bits = _to_e4m3(y)
    to = (layer * wire_blocks + dst) * 2 + kv
    tl.store(q_ptr + to * SLOT + offs, bits, mask=mask)
    heads = tl.arange(0, BLOCK_H)
    tl.store(s_ptr + to * HEADS + heads, amax / 448.0, mask=heads < HEADS)


@triton.jit
def _decode_kernel(
    q_ptr,
    s_ptr,
    x_ptr,
    src_ptr,
    dst_ptr,
    n,
    pool_blocks,
    wire_blocks,
    SLOT: tl.constexpr,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    item = tl.program_id(0).to(tl.int64)
    kv = item % 2
    i = item // 2 % n
    layer = item // 2 // n
    src = tl.load(src_ptr + i)
    dst = tl.load(dst_ptr + i)
    t = tl.arange(0, BLOCK_T)[:, None, None]
    h = tl.arange(0, BLOCK_H)[None, :, None]
    d = tl.arange(0, BLOCK_D)[None, None, :]
    mask = (t < SLOT // (HEADS * DIM)) & (h < HEADS) & (d < DIM)
    offs = (t * HEADS + h) * DIM + d
    frm = (layer * wire_blocks + src) * 2 + kv
    bits = tl.load(q_ptr + frm * SLOT + offs, mask=mask, other=0)
    heads = tl.arange(0, BLOCK_H)
    scale = tl.load(s_ptr + frm * HEADS + heads, mask=heads < HEADS, other=0.0)
    x = _from_e4m3(bits) * scale[None, :, None]
    to = (layer * pool_blocks + dst) * 2 + kv
    tl.store(x_ptr + to * SLOT + offs, x.to(x_ptr.dtype.element_ty), mask=mask)


def _meta(pool: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> dict[str, int]:
    check_blocks(pool, q, scales)
    if not (pool.is_contiguous() and q.is_contiguous() and scales.is_contiguous()):
        raise ValueError("fp8 blocks: contiguous tensors only")
    _, _, _, block_size, heads, dim = pool.shape
    return {
        "SLOT": block_size * heads * dim,
        "HEADS": heads,
        "DIM": dim,
        "BLOCK_T": triton.next_power_of_2(block_size),
        "BLOCK_H": triton.next_power_of_2(heads),
        "BLOCK_D": triton.next_power_of_2(dim),
    }


def encode_blocks(
    pool: torch.Tensor,
    src_ids: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    dst_ids: torch.Tensor,
) -> None:
    meta = _meta(pool, q, scales)
    n = src_ids.numel()
    if n:
        grid = (pool.shape[0] * n * 2,)
        src, dst = src_ids.contiguous(), dst_ids.contiguous()
        _encode_kernel[grid](pool, q, scales, src, dst, n, pool.shape[1], q.shape[1], **meta)


def decode_blocks(
    q: torch.Tensor,
    scales: torch.Tensor,
    src_ids: torch.Tensor,
    pool: torch.Tensor,
    dst_ids: torch.Tensor,
) -> None:
    meta = _meta(pool, q, scales)
    n = src_ids.numel()
    if n:
        grid = (pool.shape[0] * n * 2,)
        src, dst = src_ids.contiguous(), dst_ids.contiguous()
        _decode_kernel[grid](q, scales, pool, src, dst, n, pool.shape[1], q.shape[1], **meta)
