import pytest
import torch
import torch.nn.functional as F

from splitserve.model.linear import HALF_MATMUL_ENV, can_pack, linear, pack
from splitserve_kernels import cpu
from splitserve_kernels.reference import linear as ref

HALF = [torch.bfloat16, torch.float16]
_needs_kernels = pytest.mark.skipif(
    cpu.extension() is None, reason="the CPU kernels did not build (see the warning logged)"
)


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_matches_plain(rows):
    w, b, x = _randn(96, 40, seed=rows), _randn(96, seed=1), _randn(rows, 40, seed=2)
    packed = pack(w)
    if not can_pack(w):
        pytest.skip("MKL packing not available in this torch build")
    torch.testing.assert_close(linear(x, w, b, packed), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_onednn_packed_linear_is_bit_identical(dtype, rows, monkeypatch):
    monkeypatch.setattr(cpu, "native_matmul", lambda dtype: True)
    w, b, x = (_randn(96, 40, dtype=dtype), _randn(96, dtype=dtype), _randn(rows, 40, dtype=dtype))
    packed = pack(w)
    if packed is None or packed.kind != "onednn":
        pytest.skip(f"oneDNN {dtype} packing not available on this CPU")
    assert torch.equal(linear(x, w, b, packed), F.linear(x, w, b))


@pytest.mark.parametrize("out_features", [96, 40, 33])
def test_panels_round_trip(out_features):
    w = _randn(out_features, 24, dtype=torch.bfloat16)
    panels = ref.pack_panels(w)
    assert panels.shape == (-(-out_features // ref.PANEL), 24, ref.PANEL)
    assert torch.equal(ref.unpack_panels(panels, out_features), w)
    assert not panels.transpose(1, 2).reshape(-1, 24)[out_features:].any()


@_needs_kernels
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 64, 300])
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(96, 40), (40, 768), (500, 64), (1280, 200)]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_widened_linear_matches_reference(dtype, rows, out_features, in_features, with_bias):
    w = _randn(out_features, in_features, dtype=dtype)
    x = _randn(rows, in_features, dtype=dtype, seed=1)
    b = _randn(out_features, dtype=dtype, seed=2) if with_bias else None
    panels = ref.pack_panels(w)
    got = cpu.widened_linear(x, panels, b, out_features)
    want = ref.widened_linear(x, panels, b, out_features)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    # Both sum in float32 and round once: they differ by the order of the sums only, so at most
    # one step of the dtype where a sum lands near a rounding boundary.
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    assert (got == want).float().mean() > 0.95


@_needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9])
def test_widened_linear_does_not_depend_on_threads(rows):
    """Up to eight rows read several panels at once, the panels left over one at a time; how
    the threads split the panels changes which, never a sum's order."""
    panels = ref.pack_panels(_randn(500, 64, dtype=torch.bfloat16))
    x = _randn(rows, 64, dtype=torch.bfloat16, seed=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.widened_linear(x, panels, None, 500)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(cpu.widened_linear(x, panels, None, 500), one)


@_needs_kernels
@pytest.mark.parametrize("rows", [61, 64, 121])
def test_a_rows_output_does_not_depend_on_the_pass_it_falls_in(rows):
    """At K = 2048 rows go through the panels at most 60 at a time, the passes sharing them
    evenly (64: two of 32); a row's sums run in one order whichever pass and register block
    it lands in, so each equals the same row computed alone."""
    panels = ref.pack_panels(_randn(96, 2048, dtype=torch.bfloat16))
    x = _randn(rows, 2048, dtype=torch.bfloat16, seed=1)
    whole = cpu.widened_linear(x, panels, None, 96)
    for r in (0, rows // 2, rows - 1):
        assert torch.equal(whole[r : r + 1], cpu.widened_linear(x[r : r + 1], panels, None, 96))
    want = ref.widened_linear(x, panels, None, 96)
    torch.testing.assert_close(whole, want, rtol=1e-2, atol=1e-2)


@_needs_kernels
def test_widened_linear_refuses_mismatched_inputs():
    w = ref.pack_panels(_randn(40, 16, dtype=torch.bfloat16))
    x = _randn(3, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="panels hold 64 outputs, not 70"):
        cpu.widened_linear(x, w, None, 70)
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu.widened_linear(x.float(), w, None, 40)
    with pytest.raises(RuntimeError, match="bias"):
        cpu.widened_linear(x, w, _randn(40), 40)


@_needs_kernels
@pytest.mark.parametrize("dtype", HALF)
def test_half_weights_go_to_panels_where_the_cpu_lacks_native_matmul(dtype, monkeypatch):
    monkeypatch.setattr(cpu, "native_matmul", lambda dtype: False)
    w, b, x = _randn(96, 40, dtype=dtype), _randn(96, dtype=dtype), _randn(5, 40, dtype=dtype)
    packed = pack(w)
    assert packed is not None and packed.kind == "panels"
    want = F.linear(x.float(), w.float(), b.float()).to(dtype)
    torch.testing.assert_close(linear(x, w, b, packed), want, rtol=1e-2, atol=1e-2)


def test_native_matmul_reads_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    assert cpu.native_matmul(torch.bfloat16)
    assert not cpu.native_matmul(torch.float16)
    assert cpu.native_matmul(torch.float32)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx512f", "amx_fp16"}))
    assert cpu.native_matmul(torch.float16) and not cpu.native_matmul(torch.bfloat16)


@_needs_kernels
@pytest.mark.parametrize(
    ("forced", "native", "kind"), [("onednn", False, "onednn"), ("widened", True, "panels")]
)
def test_the_environment_overrides_the_choice(forced, native, kind, monkeypatch):
    monkeypatch.setattr(cpu, "native_matmul", lambda dtype: native)
    monkeypatch.setenv(HALF_MATMUL_ENV, forced)
    w = _randn(64, 32, dtype=torch.bfloat16)
    packed = pack(w)
    if kind == "onednn" and (packed is None or packed.kind != "onednn"):
        pytest.skip("oneDNN bfloat16 packing not available on this CPU")
    assert packed is not None and packed.kind == kind
    monkeypatch.setenv(HALF_MATMUL_ENV, "fast")
    with pytest.raises(ValueError, match="SPLITSERVE_HALF_MATMUL"):
        pack(w)
