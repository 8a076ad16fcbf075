"""The one SLO and attainment, as the bench and the simulator count it."""

from __future__ import annotations

import math

import pytest

from splitserve_tools.workload.slo import SLO, attainment

NAN = math.nan


def test_a_request_attains_with_both_targets_met_and_a_finish() -> None:
    slo = SLO(ttft_s=1.0, tpot_s=0.05)
    cases = [
        (0.9, 0.04, True, True),
        (1.0, 0.05, True, True),  # on the line is met
        (0.9, NAN, True, True),  # one token: no TPOT to miss
        (1.1, 0.04, True, False),
        (0.9, 0.06, True, False),
        (0.5, 0.01, False, False),  # never finished
        (NAN, NAN, False, False),  # never answered
    ]
    for ttft, tpot, finished, met in cases:
        assert attainment([ttft], [tpot], [finished], slo) == float(met), (ttft, tpot, finished)
    columns = list(zip(*cases, strict=True))
    assert attainment(columns[0], columns[1], columns[2], slo) == pytest.approx(3 / 7)


def test_no_requests_attain_nothing() -> None:
    assert attainment([], [], [], SLO(1.0, 1.0)) == 0.0


def test_scaling_moves_the_latency_targets_only() -> None:
    assert SLO(0.2, 0.02, 0.95).scaled(2.5) == SLO(0.5, 0.05, 0.95)
