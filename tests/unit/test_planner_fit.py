"""Latency fits recover the coefficients they were made from."""

from __future__ import annotations

import pytest

from splitserve_tools.planner.fit import (
    DecodeFit,
    DecodeRange,
    DecodeSample,
    HandoffFit,
    PrefillFit,
    PrefillSample,
    fit_decode,
    fit_handoff,
    fit_prefill,
    link_fit,
    over_link,
)


def test_prefill_fit_recovers_linear_and_quadratic_terms() -> None:
    truth = PrefillFit(a=0.004, b=2e-4, c=3e-8)
    samples = [
        PrefillSample(b, n, truth(b * n, b * n * n)) for n in (32, 128, 512, 1024) for b in (1, 4)
    ]
    fit = fit_prefill(samples)
    assert fit.a == pytest.approx(truth.a, rel=1e-6)
    assert fit.b == pytest.approx(truth.b, rel=1e-6)
    assert fit.c == pytest.approx(truth.c, rel=1e-6)


def test_decode_fit_recovers_each_range() -> None:
    small = DecodeRange(1, a=0.010, b=1e-3, c=2e-6)
    large = DecodeRange(16, a=0.030, b=4e-4, c=1e-6)
    truth = DecodeFit((small, large))
    samples = [
        DecodeSample(b, b * ctx, truth(b, b * ctx)) for b in (1, 4, 16, 64) for ctx in (64, 512)
    ]
    fit = fit_decode(samples)
    assert [r.lo for r in fit.ranges] == [1, 16]
    for got, want in zip(fit.ranges, truth.ranges, strict=True):
        assert (got.a, got.b, got.c) == pytest.approx((want.a, want.b, want.c), rel=1e-6)


def test_decode_range_with_one_batch_size_is_merged() -> None:
    samples = [DecodeSample(b, b * c, 0.01 + 1e-3 * b) for b in (1, 2, 8) for c in (16, 64)]
    fit = fit_decode(samples, bounds=(8,))
    assert [r.lo for r in fit.ranges] == [1]
    assert fit(8, 8 * 16) == pytest.approx(0.018, rel=1e-6)


def test_fits_never_go_negative_on_noisy_samples() -> None:
    # Timings where the longest prompt happened to run fast: an unconstrained fit would give
    # a negative quadratic term and predict negative times for long prompts.
    samples = [PrefillSample(1, 16, 0.010), PrefillSample(1, 64, 0.030), PrefillSample(2, 64, 0.05)]
    samples.append(PrefillSample(1, 256, 0.06))
    fit = fit_prefill(samples)
    assert min(fit.a, fit.b, fit.c) >= 0
    assert fit(4096, 4096**2) > fit(256, 256**2)


def test_handoff_fit() -> None:
    fit = fit_handoff([(1 << 16, 1e-4 + (1 << 16) / 1e10), (1 << 24, 1e-4 + (1 << 24) / 1e10)])
    assert fit.fixed_s == pytest.approx(1e-4, rel=1e-6)
    assert fit.bytes_per_s == pytest.approx(1e10, rel=1e-6)


def test_handoff_over_a_link_is_bound_by_the_slower_side() -> None:
    local = fit_handoff([(1 << 16, 1e-4 + (1 << 16) / 1e10), (1 << 24, 1e-4 + (1 << 24) / 1e10)])
    gigabit = over_link(local, 1.0, 2e-4)
    assert gigabit.bytes_per_s == pytest.approx(1.25e8)
    assert gigabit(50e6) == pytest.approx(3e-4 + 0.4, rel=1e-3)  # 4k tokens of 100m, bf16
    assert over_link(local, 400.0, 0.0).bytes_per_s == local.bytes_per_s
    with pytest.raises(ValueError, match="positive rate"):
        over_link(local, 0.0, 0.0)


def test_too_few_samples_are_refused() -> None:
    with pytest.raises(ValueError):
        fit_prefill([PrefillSample(1, 16, 0.01)])
    with pytest.raises(ValueError):
        fit_decode([DecodeSample(1, 16, 0.01), DecodeSample(1, 32, 0.01)])


def test_link_fit_reads_bench_link_rows_of_one_rate() -> None:
    rows = [
        {"rate_gbit": 1.0, "tokens": t, "bytes": t * 12288, "seconds": 1e-3 + t * 12288 / 1.2e8}
        for t in (128, 1024, 4096)
    ] + [{"rate_gbit": None, "tokens": 128, "bytes": 1 << 20, "seconds": 1e-3}]
    fit = link_fit(rows, 1.0)
    assert fit.fixed_s == pytest.approx(1e-3, rel=1e-6)
    assert fit.bytes_per_s == pytest.approx(1.2e8, rel=1e-6)
    with pytest.raises(ValueError, match="no raw link rows at rate 10"):
        link_fit(rows, 10.0)
    fp8 = [{**r, "encoding": "fp8", "seconds": 1e-3 + r["bytes"] / 2.4e8} for r in rows[:3]]
    fit = link_fit(rows + fp8, 1.0, "fp8")
    assert fit.bytes_per_s == pytest.approx(2.4e8, rel=1e-6)  # the KV's own bytes
    with pytest.raises(ValueError, match=r"no fp8 link rows at rate None.*'1.0 fp8'"):
        link_fit(rows + fp8, None, "fp8")


def test_a_streamed_handoff_adds_its_last_layer_or_what_the_pass_did_not_cover() -> None:
    whole = HandoffFit(0.001, 125e6)  # 1 Gbit/s
    streamed = HandoffFit(0.001, 125e6, stream_layers=12)
    kv = 48e6
    assert whole.added_after_pass(kv, 4.0) == whole(kv)
    # The link outruns the pass: only the last layer's transfer is left after it.
    assert streamed.added_after_pass(kv, 4.0) == pytest.approx(0.001 + kv / 12 / 125e6)
    # A pass shorter than the transfer: the remainder of the transfer, each layer's fixed cost in.
    left = 12 * 0.001 + kv / 125e6 - 0.1 * 11 / 12
    assert streamed.added_after_pass(kv, 0.1) == pytest.approx(left)
    assert HandoffFit.from_dict(streamed.to_dict()) == streamed
    assert HandoffFit.from_dict({"fixed_s": 1.0, "bytes_per_s": 2.0}).stream_layers == 0


def test_a_handoff_streamed_in_runs_of_layers_leaves_its_last_run_after_the_pass() -> None:
    # 12 layers of a 0.12 s pass (10 ms each) handed on at least 40 ms apart: every 4 layers.
    thirds = HandoffFit(0.001, 125e6, stream_layers=12, stream_min_gap_s=0.04)
    kv = 4.8e6
    # The link outruns the pass: the last third moves after it.
    assert thirds.added_after_pass(kv, 0.12) == pytest.approx(0.001 + kv / 3 / 125e6)
    # Slower than the pass: the link starts at the first third and never idles after it.
    slow = HandoffFit(0.001, 12.5e6, stream_layers=12, stream_min_gap_s=0.04)
    left = 3 * 0.001 + kv / 12.5e6 - 0.12 * 2 / 3
    assert slow.added_after_pass(kv, 0.12) == pytest.approx(left)
    # Layers longer than the gap go one by one, as with no gap.
    per_layer = HandoffFit(0.001, 125e6, stream_layers=12)
    assert thirds.added_after_pass(kv, 4.0) == pytest.approx(per_layer.added_after_pass(kv, 4.0))
    # A gap longer than the pass: all of it after the pass, as if it did not stream.
    once = HandoffFit(0.001, 125e6, stream_layers=12, stream_min_gap_s=1.0)
    assert once.added_after_pass(kv, 0.12) == pytest.approx(once(kv))
    assert HandoffFit.from_dict(thirds.to_dict()) == thirds
