"""Whole-block KV copies by block id: one program per (block, chunk of the block)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096
"""Words copied per program."""


@triton.jit
def _copy_rows_kernel(src_ptr, src_ids_ptr, dst_ptr, dst_ids_ptr, row_words, CHUNK: tl.constexpr):
    i = tl.program_id(0)
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < row_words
    src_row = tl.load(src_ids_ptr + i).to(tl.int64)
    dst_row = tl.load(dst_ids_ptr + i).to(tl.int64)
    data = tl.load(src_ptr + src_row * row_words + offs, mask=mask)
    tl.store(dst_ptr + dst_row * row_words + offs, data, mask=mask)


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t`` as rows of the widest integer words its row size allows, without a copy."""
    if not t.is_contiguous():
        raise ValueError("block copies need contiguous pools and buffers")
    flat = t.view(t.shape[0], -1).view(torch.uint8)
    row_bytes = flat.shape[1]
    for dtype in (torch.int64, torch.int32, torch.int16):
        if row_bytes % dtype.itemsize == 0 and flat.data_ptr() % dtype.itemsize == 0:
            return flat.view(dtype)
    return flat


def copy_kv_blocks(
    src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor, dst_ids: torch.Tensor
) -> None:
    """Same contract as ``reference.blocks.copy_kv_blocks``."""
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise ValueError(f"blocks of {tuple(src.shape)} and {tuple(dst.shape)} differ")
    if src_ids.numel() != dst_ids.numel():
        raise ValueError("src_ids and dst_ids differ in length")
    if src_ids.numel() == 0:
        return
    src_words, dst_words = _words(src), _words(dst)
    if src_words.dtype != dst_words.dtype:
        src_words = src_words.view(torch.uint8)
        dst_words = dst_words.view(torch.uint8)
    row = src_words.shape[1]
    grid = (src_ids.numel(), triton.cdiv(row, CHUNK))
    _copy_rows_kernel[grid](src_words, src_ids, dst_words, dst_ids, row, CHUNK=CHUNK)


def gather_kv_blocks(pool: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Same contract as ``reference.blocks.gather_kv_blocks``."""
    out = torch.empty((ids.numel(), *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
    copy_kv_blocks(pool, ids, out, torch.arange(ids.numel(), device=pool.device))
    return out


def scatter_kv_blocks(pool: torch.Tensor, ids: torch.Tensor, blocks: torch.Tensor) -> None:
    """Same contract as ``reference.blocks.scatter_kv_blocks``."""
    copy_kv_blocks(blocks, torch.arange(ids.numel(), device=pool.device), pool, ids)
