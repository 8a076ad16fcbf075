"""The C++ CPU decode attention against its pure-torch reference."""

import pytest
import torch

import splitserve_kernels as kernels
from splitserve_kernels import cpu
from splitserve_kernels.reference.attention import paged_decode_attention as reference

pytestmark = pytest.mark.skipif(
    cpu.extension() is None, reason="the CPU kernels did not build (see the warning logged)"
)


def _case(heads, kv_heads, dtype, lens, block=4, dim=16, layers=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block) for n in lens) + 1
    num_blocks = len(lens) * width + 2
    cache = torch.randn(layers, num_blocks, 2, block, kv_heads, dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    return q, cache, tables, torch.tensor(lens)


@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("window", [None, 5])
def test_matches_reference_fp32(heads, kv_heads, window):
    q, cache, tables, lens = _case(heads, kv_heads, torch.float32, [1, 7, 13, 4, 16])
    for layer in range(cache.shape[0]):
        got = cpu.paged_decode_attention(q, cache, layer, tables, lens, 0.3, window)
        want = reference(q, cache, layer, tables, lens, 0.3, window)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference_half_precision(dtype):
    q, cache, tables, lens = _case(6, 2, dtype, [3, 9, 20], dim=64)
    got = cpu.paged_decode_attention(q, cache, 1, tables, lens, 0.125)
    want = reference(q.float(), cache.float(), 1, tables, lens, 0.125).to(dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_reads_only_the_tokens_of_each_sequence():
    q, cache, tables, lens = _case(6, 2, torch.float32, [5, 2])
    want = cpu.paged_decode_attention(q, cache, 0, tables, lens, 0.5)
    block = cache.shape[3]
    poisoned = torch.full_like(cache, float("nan"))
    for row, n in zip(tables.tolist(), lens.tolist(), strict=True):
        for p in range(n):
            poisoned[:, row[p // block], :, p % block] = cache[:, row[p // block], :, p % block]
    got = cpu.paged_decode_attention(q, poisoned, 0, tables, lens, 0.5)
    torch.testing.assert_close(got, want)


def test_falls_back_to_the_reference_when_turned_off(monkeypatch):
    q, cache, tables, lens = _case(6, 2, torch.float32, [3, 8])
    monkeypatch.setattr(cpu, "extension", lambda: None)
    got = kernels.paged_decode_attention(q, cache, 2, tables, lens, 0.3)
    torch.testing.assert_close(got, reference(q, cache, 2, tables, lens, 0.3))


@pytest.mark.parametrize("dim", [40, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dims_with_and_without_a_partial_vector(dim, dtype):
    q, cache, tables, lens = _case(8, 2, dtype, [1, 17, 40], dim=dim, block=16)
    got = cpu.paged_decode_attention(q, cache, 2, tables, lens, dim**-0.5, None)
    want = reference(q.float(), cache.float(), 2, tables, lens, dim**-0.5, None).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_large_negative_scores_underflow_to_zero_weight():
    q, cache, tables, lens = _case(4, 4, torch.float32, [40], dim=32)
    got = cpu.paged_decode_attention(q * 60, cache, 0, tables, lens, 1.0)
    want = reference(q * 60, cache, 0, tables, lens, 1.0)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.isfinite(got).all()


def test_other_dtypes_use_the_reference():
    q, cache, tables, lens = _case(6, 2, torch.float64, [3, 8])
    got = kernels.paged_decode_attention(q, cache, 0, tables, lens, 0.3)
    torch.testing.assert_close(got, reference(q, cache, 0, tables, lens, 0.3))


@pytest.mark.parametrize(("heads", "kv_heads"), [(12, 4), (16, 4), (10, 2), (4, 4)])
@pytest.mark.parametrize("dim", [32, 64, 128])
@pytest.mark.parametrize(("block", "window"), [(16, None), (32, None), (16, 21), (48, 37)])
def test_bfloat16_chunks_groups_and_windows(heads, kv_heads, dim, block, window):
    lens = [1, 15, 16, 17, 33, 64, 70]
    q, cache, tables, lens_t = _case(heads, kv_heads, torch.bfloat16, lens, block=block, dim=dim)
    got = cpu.paged_decode_attention(q, cache, 1, tables, lens_t, dim**-0.5, window)
    want = reference(q.float(), cache.float(), 1, tables, lens_t, dim**-0.5, window)
    torch.testing.assert_close(got, want.to(torch.bfloat16), rtol=2e-2, atol=2e-2)


def test_threads_split_uneven_batches_without_changing_results():
    q, cache, tables, lens = _case(6, 2, torch.float32, [90, 1, 2, 3, 70, 5], dim=64, block=16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.paged_decode_attention(q, cache, 0, tables, lens, 0.2)
        torch.set_num_threads(2)
        two = cpu.paged_decode_attention(q, cache, 0, tables, lens, 0.2)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(two, one, rtol=0, atol=0)
    torch.testing.assert_close(one, reference(q, cache, 0, tables, lens, 0.2), rtol=1e-5, atol=1e-5)
