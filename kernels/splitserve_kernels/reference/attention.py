"""Attention over a block-major paged KV cache, in plain torch.

Cache tensors are the pool's ``[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]``;
``layer`` picks the layer. Positions are absolute token indices within a sequence.
"""

from __future__ import annotations

import torch


def write_kv(
    cache: torch.Tensor,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> None:
    """Store ``k``/``v`` ``[T, kv_heads, head_dim]`` at (block, offset) slots of ``layer``."""
    cache[slot_blocks, layer, 0, slot_offsets] = k
    cache[slot_blocks, layer, 1, slot_offsets] = v


def gather_kv(
    cache: torch.Tensor, layer: int, block_table: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[num_tokens, kv_heads, head_dim]`` of one sequence from its block table."""
    kv = cache[block_table, layer]  # [nb, 2, bs, kvh, d]
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
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    for i in range(len(cu_seqlens_q) - 1):
        q0, q1, k0, k1 = cu_seqlens_q[i], cu_seqlens_q[i + 1], cu_seqlens_k[i], cu_seqlens_k[i + 1]
        qi = q[q0:q1].transpose(0, 1)
        ki = k[k0:k1].transpose(0, 1)
        vi = v[k0:k1].transpose(0, 1)
        if heads != kv_heads:
            ki = ki.repeat_interleave(heads // kv_heads, dim=0)
            vi = vi.repeat_interleave(heads // kv_heads, dim=0)
        n_q, n_k = q1 - q0, k1 - k0
        if sliding_window is None and n_q == n_k:
            oi = torch.nn.functional.scaled_dot_product_attention(
                qi, ki, vi, is_causal=True, scale=scale
            )
        else:
            q_pos = torch.arange(n_k - n_q, n_k, device=q.device)
            mask = _window_mask(q_pos, torch.arange(n_k, device=q.device), sliding_window)
            oi = torch.nn.functional.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, scale=scale
            )
        out[q0:q1] = oi.transpose(0, 1)
    return out


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
    batch, heads, dim = q.shape
    kv = cache[block_tables, layer]  # [B, nb, 2, bs, kvh, d]
    kv_heads = kv.shape[-2]
    k = kv[:, :, 0].reshape(batch, -1, kv_heads, dim)
    v = kv[:, :, 1].reshape(batch, -1, kv_heads, dim)
    pos = torch.arange(k.shape[1], device=q.device)
    valid = pos[None, :] < seq_lens[:, None]
    if sliding_window is not None:
        valid &= pos[None, :] >= seq_lens[:, None] - sliding_window
    qg = q.view(batch, kv_heads, heads // kv_heads, dim)
    scores = torch.einsum("bkgd,blkd->bkgl", qg, k) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("bkgl,blkd->bkgd", probs, v).reshape(batch, heads, dim)
