"""The Triton kernels against their references: on CUDA when there is a GPU, else on CPU in
Triton's interpreter (bfloat16 only on CUDA: the interpreter garbles it)."""

import importlib.util

import pytest
import torch

import splitserve_kernels as kernels
from splitserve_kernels.reference import attention, norm, rope

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton)", allow_module_level=True)

from splitserve_kernels.gpu import attention as gpu_attention
from splitserve_kernels.gpu import norm as gpu_norm
from splitserve_kernels.gpu import rope as gpu_rope

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


def randn(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size", "window", "splits"),
    [
        (6, 2, 24, 5, None, 1),
        (6, 2, 24, 5, 7, 3),
        (4, 4, 16, 16, None, 2),
        (8, 1, 64, 16, 20, None),
        (32, 8, 128, 16, None, None),
    ],
)
def test_paged_decode_attention(dtype, heads, kv_heads, dim, block_size, window, splits):
    num_blocks, max_blocks = 40, 7
    cache = randn(2, num_blocks, 2, block_size, kv_heads, dim, dtype=dtype, seed=1)
    q = randn(3, heads, dim, dtype=dtype, seed=2)
    gen = torch.Generator().manual_seed(3)
    tables = torch.randint(0, num_blocks, (3, max_blocks), generator=gen).to(DEVICE)
    lens = torch.tensor([1, 2 * block_size + 1, max_blocks * block_size], device=DEVICE)
    got = gpu_attention.paged_decode_attention(
        q, cache, 1, tables, lens, dim**-0.5, window, num_splits=splits
    )
    want = attention.paged_decode_attention(q, cache, 1, tables, lens, dim**-0.5, window)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm_and_fused_residual(dtype, hidden):
    x = randn(5, hidden, dtype=dtype, seed=6)
    res = randn(5, hidden, dtype=dtype, seed=7)
    weight = 1 + 0.1 * randn(hidden, dtype=dtype, seed=8)
    torch.testing.assert_close(
        gpu_norm.rms_norm(x, weight, 1e-5), norm.rms_norm(x, weight, 1e-5), **TOL[dtype]
    )
    out, h = gpu_norm.add_rms_norm(x, res, weight, 1e-5)
    want_out, want_h = norm.add_rms_norm(x, res, weight, 1e-5)
    assert torch.equal(h, want_h)
    torch.testing.assert_close(out, want_out, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [16, 24, 128])
def test_rotary_on_a_strided_view(dtype, dim):
    heads, kv_heads = 4, 2
    qkv = randn(6, (heads + 2 * kv_heads) * dim, dtype=dtype, seed=9)
    q = qkv[:, : heads * dim].view(6, heads, dim)
    angles = randn(6, 1, dim // 2, seed=10)
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
    got = gpu_rope.apply_rotary(q, cos, sin)
    torch.testing.assert_close(got, rope.apply_rotary(q, cos, sin), **TOL[dtype])


def test_dispatcher_keeps_cpu_tensors_off_the_triton_kernels():
    x = torch.randn(3, 32)
    weight = torch.ones(32)
    assert not kernels.uses_kernel(x)
    # The C++ CPU kernel where it built, else the reference: equal up to the order of sums.
    torch.testing.assert_close(
        kernels.rms_norm(x, weight, 1e-6), norm.rms_norm(x, weight, 1e-6), rtol=1e-5, atol=1e-5
    )


def test_reference_can_be_forced(monkeypatch):
    monkeypatch.setenv(kernels.dispatch.FORCE_ENV, "reference")
    kernels.triton_available.cache_clear()
    try:
        assert not kernels.triton_available()
    finally:
        monkeypatch.undo()
        kernels.triton_available.cache_clear()
    assert kernels.triton_available()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (runs in scripts/gpu_check.sh)")
def test_dispatcher_picks_kernels_on_cuda_and_matches_at_serving_shapes():
    dtype, heads, kv_heads, dim, block_size = torch.bfloat16, 32, 8, 128, 16
    cache = randn(2, 600, 2, block_size, kv_heads, dim, dtype=dtype, seed=11)
    q = randn(16, heads, dim, dtype=dtype, seed=12)
    gen = torch.Generator().manual_seed(13)
    tables = torch.randperm(600, generator=gen)[: 16 * 32].view(16, 32).to(DEVICE)
    lens = torch.randint(1, 32 * block_size + 1, (16,), generator=gen).to(DEVICE)
    assert kernels.uses_kernel(q)
    got = kernels.paged_decode_attention(q, cache, 0, tables, lens, dim**-0.5)
    want = attention.paged_decode_attention(q, cache, 0, tables, lens, dim**-0.5)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
