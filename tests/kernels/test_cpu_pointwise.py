"""The C++ CPU norm, rotary + KV write, SwiGLU and greedy-token kernels against their pure-torch
references."""

import pytest
import torch

import splitserve_kernels as kernels
from splitserve_kernels import cpu
from splitserve_kernels.reference import activation, norm, rope, sampling

pytestmark = pytest.mark.skipif(
    cpu.extension() is None, reason="the CPU kernels did not build (see the warning logged)"
)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # One rounding step of the dtype: the kernels round where the references do, and differ only
    # in the order of float32 sums (and fused multiply-adds).
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [768, 40])
def test_rms_norm_matches_reference(dtype, hidden):
    x, w = _randn(37, hidden, dtype=dtype) * 3, _randn(hidden, dtype=dtype, seed=1)
    torch.testing.assert_close(cpu.rms_norm(x, w, 1e-5), norm.rms_norm(x, w, 1e-5), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_reference_and_rounds_the_sum_exactly(dtype):
    x, r = _randn(5, 3, 64, dtype=dtype), _randn(5, 3, 64, dtype=dtype, seed=2)
    w = _randn(64, dtype=dtype, seed=1)
    got, got_sum = cpu.add_rms_norm(x, r, w, 1e-6)
    want, want_sum = norm.add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(got_sum, want_sum, rtol=0, atol=0)
    torch.testing.assert_close(got, want, **_tol(dtype))
    assert got.shape == x.shape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(12, 4, 64), (4, 2, 128), (6, 3, 40)])
def test_rotary_write_kv_matches_reference(dtype, heads, kv_heads, dim):
    tokens, block, blocks = 9, 4, 8
    qkv = _randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)
    angles = _randn(tokens, 1, dim // 2, dtype=torch.float32, seed=3) * 3
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    slots = torch.randperm(blocks * block, generator=torch.Generator().manual_seed(4))[:tokens]
    slot_blocks, slot_offsets = slots // block, slots % block
    cache = _randn(3, blocks, 2, block, kv_heads, dim, dtype=dtype, seed=5)
    want_cache = cache.clone()
    args = (cos, sin, heads)
    got = cpu.rotary_write_kv(qkv, *args, cache, 1, slot_blocks, slot_offsets)
    want = rope.rotary_write_kv(qkv, *args, want_cache, 1, slot_blocks, slot_offsets)
    torch.testing.assert_close(got, want, **_tol(dtype))
    torch.testing.assert_close(cache, want_cache, **_tol(dtype))  # other slots: untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_reference_in_place(dtype):
    gate, up = _randn(7, 2048 + 5, dtype=dtype) * 4, _randn(7, 2048 + 5, dtype=dtype, seed=1)
    want = activation.silu_mul_(gate.clone(), up)
    got = cpu.silu_mul_(gate, up)
    assert got.data_ptr() == gate.data_ptr()
    torch.testing.assert_close(got, want, **_tol(dtype))


def test_silu_mul_saturates_without_nan():
    gate = torch.tensor([-200.0, -90.0, 0.0, 90.0, 200.0] * 4)
    got = cpu.silu_mul_(gate.clone(), torch.ones_like(gate))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, activation.silu_mul_(gate.clone(), torch.ones_like(gate)))


def test_dispatch_uses_references_for_other_dtypes_and_when_turned_off(monkeypatch):
    x, w = _randn(3, 32, dtype=torch.float64), _randn(32, dtype=torch.float64, seed=1)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), norm.rms_norm(x, w, 1e-6))
    monkeypatch.setattr(cpu, "extension", lambda: None)
    y = _randn(3, 32, dtype=torch.float32)
    torch.testing.assert_close(
        kernels.rms_norm(y, w.float(), 1e-6), norm.rms_norm(y, w.float(), 1e-6), rtol=0, atol=0
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [32000, 37, 5])
def test_greedy_tokens_match_reference(dtype, vocab):
    logits = _randn(9, vocab, dtype=dtype) * 4
    got = cpu.greedy_tokens(logits)
    assert got.dtype == torch.long
    assert torch.equal(got, sampling.greedy_tokens(logits))
    assert torch.equal(kernels.greedy_tokens(logits), got)


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_tokens_ties_infinities_and_nan_as_torch(dtype):
    logits = torch.zeros(6, 40, dtype=dtype)
    logits[0, [3, 17, 39]] = 2.0  # ties: the first
    logits[1] = float("-inf")  # all -inf: index 0
    logits[2, 38] = float("inf")
    logits[3, [5, 33]] = float("nan")  # NaN wins, the first one
    logits[4, 36:] = 1.0  # maximum only in the scalar tail
    logits[5, [2, 39]] = float("nan")
    logits[5, 20] = float("inf")
    assert cpu.greedy_tokens(logits).tolist() == sampling.greedy_tokens(logits).tolist()
    assert cpu.greedy_tokens(logits).tolist() == [3, 0, 38, 5, 36, 2]


def test_greedy_tokens_of_a_strided_view():
    logits = _randn(8, 100, dtype=torch.bfloat16)[::2, 10:90]
    assert torch.equal(cpu.greedy_tokens(logits), sampling.greedy_tokens(logits))
