"""TTFT/TPOT/e2e, percentiles and SLO attainment on synthetic records."""

from __future__ import annotations

import math

import pytest

from splitserve_client.stream import RequestRecord
from splitserve_tools.bench.goodput import slo_scale_sweep
from splitserve_tools.bench.metrics import percentiles, records_attainment, summarize
from splitserve_tools.workload.slo import SLO


def record(ttft: float, tpot: float, tokens: int) -> RequestRecord:
    times = [10.0 + ttft + i * tpot for i in range(tokens)]
    return RequestRecord(start=10.0, token_times=times, end=times[-1], output_tokens=tokens)


def test_record_timings() -> None:
    r = record(0.5, 0.02, 11)
    assert r.ttft == pytest.approx(0.5)
    assert r.tpot == pytest.approx(0.02)
    assert r.e2e == pytest.approx(0.7)


def test_tpot_counts_tokens_not_responses() -> None:
    """Two responses, the second carrying 9 tokens: 10 tokens over 0.45 s after the first."""
    r = RequestRecord(start=0.0, token_times=[0.1, 0.55], end=0.55, output_tokens=10)
    assert r.tpot == pytest.approx(0.05)


def test_a_record_meets_both_targets_or_misses() -> None:
    slo = SLO(ttft_s=1.0, tpot_s=0.05)
    met = [record(0.9, 0.04, 5), record(1.0, 0.05, 5), record(0.9, 9.0, 1)]
    missed = [record(1.1, 0.04, 5), record(0.9, 0.06, 5)]
    assert records_attainment(met, slo) == 1.0  # on the line is met; one token has no TPOT
    assert records_attainment(missed, slo) == 0.0


def test_errors_and_empty_streams_miss() -> None:
    slo = SLO(1.0, 1.0)
    err = record(0.1, 0.01, 3)
    err.error = "boom"
    empty = RequestRecord(start=0.0, end=1.0)
    assert records_attainment([err], slo) == 0.0 and records_attainment([empty], slo) == 0.0
    assert records_attainment([record(0.1, 0.01, 3), err, empty, record(0.2, 0.01, 3)], slo) == 0.5


def test_attainment_fraction() -> None:
    records = [record(0.1 * i, 0.01, 4) for i in range(1, 11)]  # TTFT 0.1 .. 1.0
    assert records_attainment(records, SLO(0.5, 0.1)) == pytest.approx(0.5)
    assert records_attainment(records, SLO(1.0, 0.1)) == 1.0
    assert records_attainment(records, SLO(1.0, 0.005)) == 0.0
    assert records_attainment([], SLO(1.0, 1.0)) == 0.0


def test_percentiles() -> None:
    values = [float(i) for i in range(1, 101)]
    p = percentiles([*values, math.nan])
    assert p[50] == pytest.approx(50.5)
    assert p[90] == pytest.approx(90.1)
    assert p[99] == pytest.approx(99.01)
    assert all(math.isnan(v) for v in percentiles([math.nan]).values())


def test_summary_excludes_errors_from_latency() -> None:
    fast = [record(0.1, 0.01, 10) for _ in range(9)]
    bad = RequestRecord(start=0.0, end=5.0, error="refused")
    s = summarize([*fast, bad], SLO(0.2, 0.02), duration_s=2.0)
    assert (s.num_requests, s.errors) == (10, 1)
    assert s.attainment == pytest.approx(0.9)
    assert s.ttft[99] == pytest.approx(0.1)
    assert s.output_tokens_per_s == pytest.approx(45.0)
    flat = s.flat()
    for key in ("ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p99", "e2e_p90"):
        assert key in flat


def test_slo_scale_sweep() -> None:
    records = [record(0.1 * i, 0.01 * i, 3) for i in range(1, 5)]  # (0.1,0.01) .. (0.4,0.04)
    sweep = slo_scale_sweep(records, SLO(0.2, 0.02), [0.5, 1.0, 2.5])
    assert sweep == {0.5: 0.25, 1.0: 0.5, 2.5: 1.0}
