"""Contention in the simulator, and the calibration fits that recover it from measured runs."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from test_planner_profile import synthetic_profile
from test_planner_simulate import disagg

from splitserve_tools.planner.calibrate import (
    Observed,
    fit_contention,
    fit_request_s,
    loaded_rate,
)
from splitserve_tools.planner.fit import DecodeFit, DecodeRange, PrefillFit
from splitserve_tools.planner.machine import Machine
from splitserve_tools.planner.placement import Limits, Placement
from splitserve_tools.planner.profile import Contention, Profile
from splitserve_tools.planner.simulate import Traffic, run


def test_machine_stretches_a_step_by_the_busy_share_of_the_other_cores() -> None:
    machine = Machine(Contention(prefill=0.5, decode=0.2), units=3)
    assert machine.step_seconds(1, 1.0, 1.0) == pytest.approx(2.0)
    machine.begin(1)
    assert machine.step_seconds(1, 1.0, 1.0) == pytest.approx(1.25 + 1.1)
    machine.begin(1)
    assert machine.step_seconds(1, 1.0, 1.0) == pytest.approx(1.5 + 1.2)
    machine.end(2)
    assert machine.step_seconds(3, 1.0, 0.0) == pytest.approx(1.0)


def test_contention_slows_decode_only_while_prefill_runs() -> None:
    """One long stream decodes; prompts arrive during part of it. With decode contention its
    TPOT rises by the factor times the share of steps that ran beside a prompt pass."""
    profile = synthetic_profile(
        prefill=PrefillFit(0.05, 0.0, 0.0), decode=DecodeFit((DecodeRange(1, 0.01, 0.0, 0.0),))
    )
    traffic = Traffic(((16, 400),) + ((16, 1),) * 40, "fixed")
    quiet = run(profile, disagg(), traffic, 10.0)
    busy = run(replace(profile, contention=Contention(0.0, 0.5)), disagg(), traffic, 10.0)
    assert quiet.tpot[0] == pytest.approx(0.01, rel=0.02)
    assert 0.01 * 1.1 < busy.tpot[0] < 0.01 * 1.5
    np.testing.assert_allclose(busy.ttft[1:], quiet.ttft[1:], rtol=0.3)


def test_first_token_leaves_between_two_decode_steps() -> None:
    """Decode sends a prefilled request's first token when its current step ends: with the
    decode instance idle, TTFT is the prefill; beside a long stream, up to a step more."""
    step = 0.1
    profile = synthetic_profile(
        prefill=PrefillFit(0.01, 0.0, 0.0), decode=DecodeFit((DecodeRange(1, step, 0.0, 0.0),))
    )
    alone = run(profile, disagg(), Traffic(((16, 2),), "fixed"), 1.0)
    assert alone.ttft[0] == pytest.approx(0.01)
    beside = run(profile, disagg(), Traffic(((16, 50), (16, 2)), "fixed"), 1 / 0.55)
    assert 0.01 < beside.ttft[1] <= 0.01 + step + 1e-3


def _observed(profile: Profile, placement: Placement, traffic: Traffic, rate: float) -> Observed:
    sim = run(profile, placement, traffic, rate)
    return Observed(rate, traffic.lengths, sim.ttft, sim.tpot)


def test_fit_recovers_the_contention_it_was_simulated_with() -> None:
    profile = synthetic_profile(
        prefill=PrefillFit(0.005, 2e-4, 0.0), decode=DecodeFit((DecodeRange(1, 0.02, 5e-4, 1e-6),))
    )
    placement = disagg(limits=Limits())
    traffic = Traffic.of_workload("chatbot", 200, 2048, seed=5)
    rate = loaded_rate(profile, placement, [n for n, _ in traffic.lengths], 0.6)
    truth = Contention(0.3, 0.15)
    seen = _observed(replace(profile, contention=truth), placement, traffic, rate)
    got, error = fit_contention(profile, placement, seen, seed=5)
    assert got == truth
    assert error == pytest.approx(0.0, abs=1e-9)


def test_request_cost_is_the_median_ttft_beyond_the_profiled_prefill() -> None:
    profile = synthetic_profile(prefill=PrefillFit(0.01, 1e-4, 0.0))
    prefill_s = 0.01 + 1e-4 * 100
    ttft = np.array([prefill_s + 0.004, prefill_s + 0.005, prefill_s + 0.5])
    alone = Observed(1.0, ((100, 2),) * 3, ttft, np.full(3, np.nan))
    assert fit_request_s(profile, disagg(), alone) == pytest.approx(0.005)


def test_loaded_rate_keeps_prefill_busy_by_the_profile() -> None:
    profile = synthetic_profile(prefill=PrefillFit(0.01, 1e-4, 0.0))
    rate = loaded_rate(profile, disagg(prefill=2), [100, 300], 0.5)
    assert rate == pytest.approx(0.5 * 2 / 0.03)


def test_observed_from_a_bench_report_refuses_runs_with_errors() -> None:
    ok = {"requests": [{"input_len": 8, "output_len": 1, "ttft": 0.1, "tpot": None,
                        "error": None}], "rate": 2.0}  # fmt: skip
    seen = Observed.from_bench_run(ok)
    assert seen.lengths == ((8, 1),) and np.isnan(seen.tpot[0])
    bad = {"requests": [dict(ok["requests"][0], error="UNAVAILABLE")], "rate": 2.0}
    with pytest.raises(ValueError, match="errors"):
        Observed.from_bench_run(bad)
