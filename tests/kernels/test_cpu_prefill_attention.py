"""The C++ CPU prefill attention against its pure-torch reference."""

import pytest
import torch

import splitserve_kernels as kernels
from splitserve_kernels import cpu
from splitserve_kernels.reference.attention import paged_prefill_attention as reference

pytestmark = pytest.mark.skipif(
    cpu.extension() is None, reason="the CPU kernels did not build (see the warning logged)"
)


def _case(heads, kv_heads, dtype, new, cached=None, block=16, dim=64, layers=2, seed=0):
    """A cache holding ``cached[i] + new[i]`` tokens of each sequence in shuffled blocks, and the
    new tokens' queries."""
    gen = torch.Generator().manual_seed(seed)
    cached = cached or [0] * len(new)
    totals = [c + n for c, n in zip(cached, new, strict=True)]
    widths = [-(-t // block) for t in totals]
    num_blocks = sum(widths) + 3
    cache = torch.randn(layers, num_blocks, 2, block, kv_heads, dim, generator=gen).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen)
    tables, start = [], 0
    for w in widths:
        tables.append(ids[start : start + w])
        start += w
    q = torch.randn(sum(new), heads, dim, generator=gen).to(dtype)
    cu_q, cu_k = [0], [0]
    for n, t in zip(new, totals, strict=True):
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + t)
    return q, cache, tables, cu_q, cu_k


def _check(case, dtype, layer=1, scale=0.125, window=None):
    q, cache, tables, cu_q, cu_k = case
    got = cpu.paged_prefill_attention(q, cache, layer, tables, cu_q, cu_k, scale, window)
    want = reference(q.float(), cache.float(), layer, tables, cu_q, cu_k, scale, window)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize(("heads", "kv_heads"), [(12, 4), (4, 4), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_reference(heads, kv_heads, dtype):
    # Prompt lengths on both sides of the 64-token tiles and key blocks.
    _check(_case(heads, kv_heads, dtype, [1, 63, 64, 65, 200]), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_after_a_cached_prefix(dtype):
    # The new tokens attend to the cached ones first (prefix cache, chunked prompts).
    _check(_case(6, 2, dtype, [5, 70, 1, 130], cached=[16, 3, 200, 64]), dtype)


@pytest.mark.parametrize("window", [1, 7, 64, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window(window, dtype):
    _check(_case(6, 2, dtype, [150, 20], cached=[0, 90]), dtype, window=window)


@pytest.mark.parametrize("dim", [32, 128])
@pytest.mark.parametrize("block", [4, 5, 32])
def test_head_dims_and_block_sizes(dim, block):
    _check(
        _case(8, 2, torch.bfloat16, [33, 97], cached=[7, 0], block=block, dim=dim),
        torch.bfloat16,
        scale=dim**-0.5,
    )


def test_reads_only_the_tokens_of_each_sequence():
    q, cache, tables, cu_q, cu_k = _case(6, 2, torch.float32, [40, 9], cached=[3, 30])
    want = cpu.paged_prefill_attention(q, cache, 0, tables, cu_q, cu_k, 0.5)
    block = cache.shape[3]
    poisoned = torch.full_like(cache, float("nan"))
    for i, table in enumerate(tables):
        for p in range(cu_k[i + 1] - cu_k[i]):
            slot = (table[p // block], p % block)
            poisoned[:, slot[0], :, slot[1]] = cache[:, slot[0], :, slot[1]]
    got = cpu.paged_prefill_attention(q, poisoned, 0, tables, cu_q, cu_k, 0.5)
    torch.testing.assert_close(got, want)


def test_large_scores_stay_finite():
    q, cache, tables, cu_q, cu_k = _case(4, 4, torch.float32, [90], dim=32)
    got = cpu.paged_prefill_attention(q * 60, cache, 0, tables, cu_q, cu_k, 1.0)
    want = reference(q * 60, cache, 0, tables, cu_q, cu_k, 1.0)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.isfinite(got).all()


def test_two_threads_split_the_work_the_same_way():
    q, cache, tables, cu_q, cu_k = _case(12, 4, torch.bfloat16, [300, 20])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.paged_prefill_attention(q, cache, 0, tables, cu_q, cu_k, 0.125)
        torch.set_num_threads(2)
        two = cpu.paged_prefill_attention(q, cache, 0, tables, cu_q, cu_k, 0.125)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(one, two, rtol=0, atol=0)


def test_dispatch_uses_the_reference_for_other_head_dims(monkeypatch):
    q, cache, tables, cu_q, cu_k = _case(4, 2, torch.float32, [10], dim=16)
    monkeypatch.setattr(
        cpu, "paged_prefill_attention", lambda *a: pytest.fail("kernel called for dim 16")
    )
    got = kernels.paged_prefill_attention(q, cache, 1, tables, cu_q, cu_k, 0.25)
    torch.testing.assert_close(got, reference(q, cache, 1, tables, cu_q, cu_k, 0.25))


def test_falls_back_to_the_reference_when_turned_off(monkeypatch):
    q, cache, tables, cu_q, cu_k = _case(6, 2, torch.float32, [12, 5], cached=[0, 4])
    monkeypatch.setattr(cpu, "extension", lambda: None)
    got = kernels.paged_prefill_attention(q, cache, 0, tables, cu_q, cu_k, 0.3)
    torch.testing.assert_close(got, reference(q, cache, 0, tables, cu_q, cu_k, 0.3))


def test_bad_bounds_are_refused_not_read():
    q, cache, tables, cu_q, cu_k = _case(6, 2, torch.float32, [20], cached=[10])
    with pytest.raises(RuntimeError, match="block table"):
        cpu.paged_prefill_attention(q, cache, 0, [tables[0][:1]], cu_q, cu_k, 0.5)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu.paged_prefill_attention(q, cache, 0, [tables[0] + 1000], cu_q, cu_k, 0.5)
    with pytest.raises(RuntimeError, match="queries"):
        cpu.paged_prefill_attention(q, cache, 0, tables, cu_q, [0, 5], 0.5)
