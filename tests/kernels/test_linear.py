import pytest
import torch
import torch.nn.functional as F

from splitserve.model.linear import can_pack, linear, pack


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_matches_plain(rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=gen)
    b = torch.randn(96, generator=gen)
    x = torch.randn(rows, 40, generator=gen)
    packed = pack(w)
    if not can_pack(w):
        pytest.skip("MKL packing not available in this torch build")
    torch.testing.assert_close(linear(x, w, b, packed), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_half_precision_packed_linear_is_bit_identical(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=gen).to(dtype)
    b = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(rows, 40, generator=gen).to(dtype)
    if not can_pack(w):
        pytest.skip(f"oneDNN {dtype} packing not available on this CPU")
    assert torch.equal(linear(x, w, b, pack(w)), F.linear(x, w, b))
