"""Whole-block KV copies between pools and staging buffers, in plain torch.

A pool is ``[num_blocks, *block_shape]`` (see ``splitserve.kv.layout``); a block is one
contiguous row, so moving blocks is a row gather/scatter by block id.
"""

from __future__ import annotations

import torch


def copy_kv_blocks(
    src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor, dst_ids: torch.Tensor
) -> None:
    """``dst[dst_ids[i]] = src[src_ids[i]]`` for every ``i``; ids are long tensors on the
    tensors' device, ``dst_ids`` distinct."""
    dst.index_copy_(0, dst_ids, src.index_select(0, src_ids))


def gather_kv_blocks(pool: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The blocks ``ids`` of ``pool``, packed in order into a new ``[len(ids), ...]`` tensor."""
    return pool.index_select(0, ids)


def scatter_kv_blocks(pool: torch.Tensor, ids: torch.Tensor, blocks: torch.Tensor) -> None:
    """Write packed ``blocks`` ``[len(ids), ...]`` into the blocks ``ids`` of ``pool``."""
    pool.index_copy_(0, ids, blocks)
