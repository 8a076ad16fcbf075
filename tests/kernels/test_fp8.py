"""FP8 transfer encoding of KV blocks: the reference's contract, and the C++ CPU kernels and the
Triton kernels (Triton's interpreter on CPU where there is no GPU) against it."""

import importlib.util

import pytest
import torch

from splitserve_kernels import cpu
from splitserve_kernels.reference import fp8

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def pool_of(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """KV with heads of very different magnitudes (so scales differ per head and small values
    land in e4m3's subnormal range), a head of zeros and outliers."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen)
    heads = shape[4]
    x *= torch.logspace(-3, 2, heads)[None, None, None, None, :, None]
    x[:, :, :, :, 0] = 0.0
    x.view(-1)[::97] *= 40.0
    return x.to(dtype)


def wire_for(pool: torch.Tensor, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    layers, _, _, bs, heads, dim = pool.shape
    q = torch.full((layers, blocks, 2, bs, heads, dim), 0xAA, dtype=torch.uint8)
    return q, torch.full((layers, blocks, 2, heads), -1.0)


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def test_reference_maps_each_heads_largest_value_to_448_and_round_trips():
    pool = pool_of((2, 6, 2, 4, 3, 8), torch.float32)
    q, scales = wire_for(pool, 5)
    fp8.encode_blocks(pool, ids(4, 1, 2), q, scales, ids(0, 3, 4))
    assert (q[:, [1, 2]] == 0xAA).all() and (scales[:, [1, 2]] == -1).all()  # untouched
    x = pool[:, [4, 1, 2]]
    amax = x.abs().amax(dim=(3, 5))
    torch.testing.assert_close(scales[:, [0, 3, 4]], amax / 448.0, rtol=0, atol=0)
    top = q[:, [0, 3, 4]].view(torch.float8_e4m3fn).float().abs().amax(dim=(3, 5))
    assert (top[..., 1:] == 448.0).all() and (top[..., 0] == 0).all()  # head 0 is all zeros
    back = torch.zeros_like(pool)
    fp8.decode_blocks(q, scales, ids(0, 3, 4), back, ids(1, 2, 5))
    got = back[:, [1, 2, 5]]
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normals; values below 2^-6 of
    # the scale are multiples of 2^-9 of it.
    bound = torch.maximum(x.abs() / 16, (amax / 448 * 2**-10)[:, :, :, None, :, None])
    assert ((got - x).abs() <= bound).all()
    assert (back[:, [0, 3, 4]] == 0).all()


def test_reference_refuses_mismatched_wire_blocks():
    pool = pool_of((2, 4, 2, 4, 3, 8), torch.float32)
    q, scales = wire_for(pool, 4)
    with pytest.raises(ValueError, match="scales"):
        fp8.encode_blocks(pool, ids(0), q, scales[:, :, :, :2], ids(0))
    with pytest.raises(ValueError, match="uint8"):
        fp8.encode_blocks(pool, ids(0), q.float(), scales, ids(0))


def _same_bits(impl, dtype: torch.dtype, shape: tuple[int, ...], device: str = "cpu") -> None:
    pool = pool_of(shape, dtype).to(device)
    src, dst = ids(5, 0, 3, 2), ids(1, 6, 0, 2)
    want_q, want_s = (t.to(device) for t in wire_for(pool, 7))
    got_q, got_s = want_q.clone(), want_s.clone()
    fp8.encode_blocks(pool, src.to(device), want_q, want_s, dst.to(device))
    impl.encode_blocks(pool, src.to(device), got_q, got_s, dst.to(device))
    assert torch.equal(got_s, want_s)
    assert torch.equal(got_q, want_q), (got_q != want_q).sum()
    want_x, got_x = torch.zeros_like(pool), torch.zeros_like(pool)
    fp8.decode_blocks(want_q, want_s, dst.to(device), want_x, src.to(device))
    impl.decode_blocks(got_q, got_s, dst.to(device), got_x, src.to(device))
    assert torch.equal(got_x, want_x)


@pytest.mark.skipif(cpu.extension() is None, reason="the CPU kernels did not build")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 8, 2, 16, 4, 64), (2, 8, 2, 5, 3, 24)])
def test_cpu_kernels_give_the_references_bits(dtype, shape):
    _same_bits(cpu, dtype, shape)


@pytest.mark.skipif(cpu.extension() is None, reason="the CPU kernels did not build")
def test_cpu_e4m3_rounding_matches_torch_on_every_float_range():
    # One head, one block: values from 2^-20 to 448 (the scale is 1 when amax is 448), both
    # signs, halfway cases included: every e4m3 code and the rounding between codes.
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[codes.isfinite()]
    finite = torch.sort(codes[codes >= 0]).values
    halves = (finite[:-1] + finite[1:]) / 2
    gen = torch.Generator().manual_seed(0)
    spread = torch.exp2(torch.empty(4000).uniform_(-20, 8.8, generator=gen))
    values = torch.cat([finite, halves, spread.clamp(max=448.0)])
    values = torch.cat([values, -values])
    dim = 16
    values = torch.cat([values, torch.zeros((-len(values)) % dim)])
    pool = values.view(1, 1, 1, -1, 1, dim).expand(1, 1, 2, -1, 1, dim).contiguous()
    pool[0, 0, :, 0, 0, 0] = 448.0
    q, scales = wire_for(pool, 1)
    cpu.encode_blocks(pool, ids(0), q, scales, ids(0))
    assert (scales == 1.0).all()
    want = pool.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(q, want), pool[q != want][:8]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.filterwarnings("ignore:divide by zero")  # the interpreter's 448 / 0 of a zero head
@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else []),
)
def test_triton_kernels_give_the_references_bits(dtype, monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from splitserve_kernels.gpu import fp8 as gpu_fp8

    device = "cuda" if torch.cuda.is_available() else "cpu"
    _same_bits(gpu_fp8, dtype, (2, 8, 2, 4, 3, 24), device)
