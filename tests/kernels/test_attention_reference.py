"""The paged attention references against dense attention computed the plain way."""

import pytest
import torch

from splitserve_kernels import (
    gather_kv,
    paged_decode_attention,
    varlen_prefill_attention,
    write_kv,
)

LAYERS, BLOCK, KV_HEADS, HEADS, DIM = 2, 4, 2, 6, 8


def dense(q, k, v, q_pos, scale, window):
    """q [Tq, H, d] at absolute positions q_pos; k/v [Tk, kvh, d] at positions 0..Tk-1."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    k_pos = torch.arange(k.shape[0])
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def fill(cache, layer, table, k, v):
    n = k.shape[0]
    blocks = torch.tensor([table[p // BLOCK] for p in range(n)])
    offsets = torch.tensor([p % BLOCK for p in range(n)])
    write_kv(cache, layer, k, v, blocks, offsets)


@pytest.mark.parametrize("window", [None, 5])
def test_paged_decode_matches_dense(window):
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(LAYERS, 32, 2, BLOCK, KV_HEADS, DIM, generator=gen)
    lens = [1, 7, 13]
    tables = [[3, 9, 1, 30], [5, 2, 8, 11], [0, 4, 6, 7]]
    qs, outs = [], []
    for table, n in zip(tables, lens, strict=True):
        k = torch.randn(n, KV_HEADS, DIM, generator=gen)
        v = torch.randn(n, KV_HEADS, DIM, generator=gen)
        fill(cache, 1, table, k, v)
        q = torch.randn(1, HEADS, DIM, generator=gen)
        qs.append(q)
        outs.append(dense(q, k, v, torch.tensor([n - 1]), 0.3, window))
    got = paged_decode_attention(
        torch.cat(qs), cache, 1, torch.tensor(tables), torch.tensor(lens), 0.3, window
    )
    torch.testing.assert_close(got, torch.cat(outs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 3])
def test_varlen_prefill_with_and_without_context_matches_dense(window):
    gen = torch.Generator().manual_seed(1)
    q_lens, ctx_lens = [5, 1, 9], [0, 4, 3]
    qs, ks, vs, refs = [], [], [], []
    cu_q, cu_k = [0], [0]
    for nq, nc in zip(q_lens, ctx_lens, strict=True):
        q = torch.randn(nq, HEADS, DIM, generator=gen)
        k = torch.randn(nc + nq, KV_HEADS, DIM, generator=gen)
        v = torch.randn(nc + nq, KV_HEADS, DIM, generator=gen)
        refs.append(dense(q, k, v, torch.arange(nc, nc + nq), 0.25, window))
        qs.append(q)
        ks.append(k)
        vs.append(v)
        cu_q.append(cu_q[-1] + nq)
        cu_k.append(cu_k[-1] + nc + nq)
    got = varlen_prefill_attention(
        torch.cat(qs), torch.cat(ks), torch.cat(vs), cu_q, cu_k, 0.25, window
    )
    torch.testing.assert_close(got, torch.cat(refs), rtol=1e-5, atol=1e-5)


def test_gather_returns_what_write_stored():
    gen = torch.Generator().manual_seed(2)
    cache = torch.zeros(LAYERS, 16, 2, BLOCK, KV_HEADS, DIM)
    k = torch.randn(10, KV_HEADS, DIM, generator=gen)
    v = torch.randn(10, KV_HEADS, DIM, generator=gen)
    fill(cache, 0, [7, 2, 12], k, v)
    gk, gv = gather_kv(cache, 0, torch.tensor([7, 2, 12]), 10)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    assert cache[1].abs().sum() == 0
