"""The served-pass fit across nodes (planner.served_pass)."""

from __future__ import annotations

import pytest

from splitserve_tools.planner.fit import PrefillFit
from splitserve_tools.planner.profile import ServingOverhead
from splitserve_tools.planner.served_pass import Cell, fit_served_pass

FIT = PrefillFit(0.0, 1e-3, 0.0)  # 1 ms per token


def test_factors_and_request_time_are_medians_over_their_cells() -> None:
    cells = [
        Cell(100, False, 0.110, 0.120),
        Cell(1000, False, 1.100, 1.110),
        Cell(1000, False, 1.500, 1.510),  # one slow pass moves no median
        Cell(1000, True, 1.320, 1.330),
        Cell(2000, True, 2.640, 2.650),
    ]
    fitted = fit_served_pass(ServingOverhead(token_s=3e-4), FIT, cells)
    assert fitted.token_s == 3e-4
    assert fitted.pass_factor == pytest.approx(1.1)
    assert fitted.stream_pass_factor == pytest.approx(1.2)
    assert fitted.request_s == pytest.approx(0.010)


def test_a_factor_without_cells_stays_and_request_time_is_never_negative() -> None:
    start = ServingOverhead(pass_factor=1.05, stream_pass_factor=1.3)
    fitted = fit_served_pass(start, FIT, [Cell(1000, False, 1.2, 1.1)])
    assert fitted.pass_factor == pytest.approx(1.2)
    assert fitted.stream_pass_factor == 1.3
    assert fitted.request_s == 0.0
    with pytest.raises(ValueError, match="at least one cell"):
        fit_served_pass(start, FIT, [])


def test_cells_from_bench_rows_stream_by_mode_and_threshold() -> None:
    row = {"mode": "layerwise-fp8", "tokens": 128, "pass_s": 0.08, "ttft_s": 0.09}
    assert not Cell.from_row(row, 256).streamed
    assert Cell.from_row({**row, "tokens": 1024}, 256).streamed
    assert not Cell.from_row({**row, "mode": "whole", "tokens": 1024}, 256).streamed
    # Pushes move every prompt by layer, whatever the pull threshold.
    assert Cell.from_row({**row, "mode": "push"}, 256).streamed
