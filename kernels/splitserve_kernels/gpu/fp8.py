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
def _slots(
    pool_ids_ptr,
    wire_ids_ptr,
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
    """This program's K or V of one layer and block pair: where it lies in the pool and in the
    wire blocks (in slots of ``SLOT`` values), and the offsets and mask of its values."""
    item = tl.program_id(0).to(tl.int64)
    kv = item % 2
    i = item // 2 % n
    layer = item // 2 // n
    pool_slot = (layer * pool_blocks + tl.load(pool_ids_ptr + i)) * 2 + kv
    wire_slot = (layer * wire_blocks + tl.load(wire_ids_ptr + i)) * 2 + kv
    t = tl.arange(0, BLOCK_T)[:, None, None]
    h = tl.arange(0, BLOCK_H)[None, :, None]
    d = tl.arange(0, BLOCK_D)[None, None, :]
    mask = (t < SLOT // (HEADS * DIM)) & (h < HEADS) & (d < DIM)
    return pool_slot, wire_slot, (t * HEADS + h) * DIM + d, mask


@triton.jit
def _encode_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    pool_ids_ptr,
    wire_ids_ptr,
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
    frm, to, offs, mask = _slots(
        pool_ids_ptr, wire_ids_ptr, n, pool_blocks, wire_blocks,
        SLOT, HEADS, DIM, BLOCK_T, BLOCK_H, BLOCK_D,
    )  # fmt: skip
    x = tl.load(x_ptr + frm * SLOT + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=2), axis=0)  # [BLOCK_H]
    factor = tl.where(amax == 0.0, 1.0, tl.math.div_rn(448.0, amax))
    tl.store(q_ptr + to * SLOT + offs, _to_e4m3(x * factor[None, :, None]), mask=mask)
    heads = tl.arange(0, BLOCK_H)
    tl.store(s_ptr + to * HEADS + heads, amax / 448.0, mask=heads < HEADS)


@triton.jit
def _decode_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    pool_ids_ptr,
    wire_ids_ptr,
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
    to, frm, offs, mask = _slots(
        pool_ids_ptr, wire_ids_ptr, n, pool_blocks, wire_blocks,
        SLOT, HEADS, DIM, BLOCK_T, BLOCK_H, BLOCK_D,
    )  # fmt: skip
    bits = tl.load(q_ptr + frm * SLOT + offs, mask=mask, other=0)
    heads = tl.arange(0, BLOCK_H)
    scale = tl.load(s_ptr + frm * HEADS + heads, mask=heads < HEADS, other=0.0)
    x = _from_e4m3(bits) * scale[None, :, None]
    tl.store(x_ptr + to * SLOT + offs, x.to(x_ptr.dtype.element_ty), mask=mask)


def _launch(
    kernel: triton.JITFunction,
    pool: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    pool_ids: torch.Tensor,
    wire_ids: torch.Tensor,
) -> None:
    check_blocks(pool, q, scales)
    if not (pool.is_contiguous() and q.is_contiguous() and scales.is_contiguous()):
        raise ValueError("fp8 blocks: contiguous tensors only")
    _, _, _, block_size, heads, dim = pool.shape
    n = pool_ids.numel()
    if n:
        kernel[(pool.shape[0] * n * 2,)](
            pool, q, scales, pool_ids.contiguous(), wire_ids.contiguous(), n,
            pool.shape[1], q.shape[1],
            SLOT=block_size * heads * dim, HEADS=heads, DIM=dim,
            BLOCK_T=triton.next_power_of_2(block_size), BLOCK_H=triton.next_power_of_2(heads),
            BLOCK_D=triton.next_power_of_2(dim),
        )  # fmt: skip


def encode_blocks(
    pool: torch.Tensor,
    src_ids: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    dst_ids: torch.Tensor,
) -> None:
    _launch(_encode_kernel, pool, q, scales, src_ids, dst_ids)


def decode_blocks(
    q: torch.Tensor,
    scales: torch.Tensor,
    src_ids: torch.Tensor,
    pool: torch.Tensor,
    dst_ids: torch.Tensor,
) -> None:
    _launch(_decode_kernel, pool, q, scales, dst_ids, src_ids)
