"""Attention over a layer-major paged KV cache, in plain torch.

Cache tensors are the pool's ``[num_layers, num_blocks, 2, block_size, kv_heads, head_dim]``;
``layer`` picks the layer. Positions are absolute token indices within a sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    cache: torch.Tensor,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> None:
    """Store ``k``/``v`` ``[T, kv_heads, head_dim]`` at (block, offset) slots of ``layer``."""
    cache[layer, slot_blocks, 0, slot_offsets] = k
    cache[layer, slot_blocks, 1, slot_offsets] = v


def gather_kv(
    cache: torch.Tensor, layer: int, block_table: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[num_tokens, kv_heads, head_dim]`` of one sequence from its block table."""
    kv = cache[layer, block_table]  # [nb, 2, bs, kvh, d]
    kv = kv.transpose(0, 1).reshape(2, -1, *kv.shape[-2:])
    return kv[0, :num_tokens], kv[1, :num_tokens]


def _window_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return mask


def varlen_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: list[int],
    cu_seqlens_k: list[int],
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed sequences, queries aligned to the end of their keys.

    ``q`` ``[Tq, heads, d]``; ``k``/``v`` ``[Tk, kv_heads, d]``; sequence ``i`` owns
    ``q[cu_q[i]:cu_q[i+1]]`` and ``k[cu_k[i]:cu_k[i+1]]`` (keys = cached context + new tokens).
    """
    out = torch.empty_like(q)
    for i in range(len(cu_seqlens_q) - 1):
        q0, q1, k0, k1 = cu_seqlens_q[i], cu_seqlens_q[i + 1], cu_seqlens_k[i], cu_seqlens_k[i + 1]
        # [1, heads, T, d]: the 4-D form reaches torch's fused CPU attention kernel.
        qi, ki, vi = (x.transpose(0, 1)[None] for x in (q[q0:q1], k[k0:k1], v[k0:k1]))
        n_q, n_k = q1 - q0, k1 - k0
        if sliding_window is None and n_q == n_k:
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            q_pos = torch.arange(n_k - n_q, n_k, device=q.device)
            mask = _window_mask(q_pos, torch.arange(n_k, device=q.device), sliding_window)
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True
            )
        out[q0:q1] = oi[0].transpose(0, 1)
    return out


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
    """``varlen_prefill_attention`` over keys and values gathered from the cache: sequence ``i``'s
    are its first ``cu_k[i+1] - cu_k[i]`` tokens in the blocks of ``block_tables[i]`` (cached
    context, then this pass's tokens, already written)."""
    parts = [
        gather_kv(cache, layer, table, cu_seqlens_k[i + 1] - cu_seqlens_k[i])
        for i, table in enumerate(block_tables)
    ]
    # One prompt (the usual prefill batch): its gathered tensors as they are, not copied again.
    k, v = parts[0] if len(parts) == 1 else (torch.cat(t) for t in zip(*parts, strict=True))
    return varlen_prefill_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, sliding_window)


def paged_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One query token per sequence against its cached keys.

    ``q`` ``[B, heads, d]``; ``block_tables`` ``[B, max_blocks]`` (padding entries may hold any
    valid block id); ``seq_lens`` ``[B]`` counts the keys of each sequence, the new token included.
    """
    batch, max_blocks = block_tables.shape
    _, _, _, block_size, kv_heads, dim = cache.shape
    kv = cache[layer].index_select(0, block_tables.reshape(-1))
    kv = kv.view(batch, max_blocks, 2, block_size, kv_heads, dim)
    kv = kv.permute(2, 0, 4, 1, 3, 5).reshape(2, batch, kv_heads, max_blocks * block_size, dim)
    pos = torch.arange(max_blocks * block_size, device=q.device)
    valid = pos[None, :] < seq_lens[:, None]
    if sliding_window is not None:
        valid &= pos[None, :] >= seq_lens[:, None] - sliding_window
    out = F.scaled_dot_product_attention(
        q[:, :, None], kv[0], kv[1], attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True
    )
    return out[:, :, 0]
