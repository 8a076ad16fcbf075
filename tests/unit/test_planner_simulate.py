"""The discrete-event simulator against queueing theory and against what disaggregation is for."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
from test_planner_profile import synthetic_profile

from splitserve_tools.planner import simulate
from splitserve_tools.planner.fit import DecodeFit, DecodeRange, PrefillFit
from splitserve_tools.planner.placement import Limits, Placement, Role
from splitserve_tools.planner.profile import ServingOverhead
from splitserve_tools.planner.simulate import Traffic, pool_blocks, run

ONE_BY_ONE = Limits(prefill_max_batch_size=1, prefill_queue_delay_s=0.0)


def disagg(prefill: int = 1, decode: int = 1, limits: Limits = ONE_BY_ONE) -> Placement:
    return Placement("disagg", prefill=Role(prefill, 1), decode=Role(decode, 1), limits=limits)


def placement(mode: str, limits: Limits) -> Placement:
    """One device per role."""
    if mode == "disagg":
        return disagg(limits=limits)
    return Placement("colocated", colocated=Role(1, 1), limits=limits)


def test_prefill_queue_is_md1() -> None:
    """One prefill instance, one request per batch, a fixed service time D, Poisson arrivals:
    an M/D/1 queue, whose mean time in system is D + ρD / (2(1 - ρ))."""
    service = 0.01
    profile = synthetic_profile(prefill=PrefillFit(service, 0.0, 0.0))
    traffic = Traffic(((16, 1),) * 20000, "poisson", seed=3)
    for rho in (0.5, 0.8):
        result = run(profile, disagg(), traffic, rho / service)
        theory = service + rho * service / (2 * (1 - rho))
        assert float(np.mean(result.ttft)) == pytest.approx(theory, rel=0.06)


def test_dynamic_batching_waits_for_the_queue_delay() -> None:
    """A lone request waits the whole queue delay for company before its batch goes."""
    profile = synthetic_profile(prefill=PrefillFit(0.01, 0.0, 0.0))
    limits = Limits(prefill_max_batch_size=8, prefill_queue_delay_s=0.005)
    result = run(profile, disagg(limits=limits), Traffic(((16, 1),), "fixed"), 1.0)
    assert result.ttft[0] == pytest.approx(0.015)


def test_decode_alone_gives_the_step_time_as_tpot() -> None:
    step = DecodeFit((DecodeRange(1, 0.02, 0.0, 0.0),))
    profile = synthetic_profile(decode=step)
    result = run(profile, disagg(), Traffic(((16, 50),), "fixed"), 1.0)
    # The first gap also holds the handoff (0.1 ms fixed + 16 KiB at 10 GB/s).
    assert result.tpot[0] == pytest.approx(0.02, rel=0.01)
    assert result.e2e[0] == pytest.approx(result.ttft[0] + 49 * result.tpot[0], rel=1e-9)


def test_attainment_falls_as_the_rate_rises() -> None:
    profile = synthetic_profile()
    traffic = Traffic.of_workload("chatbot", 300, 2048, seed=1)
    rates = [0.5, 1, 2, 4, 8, 16, 32]
    got = [run(profile, disagg(), traffic, r).attainment(1.0, 0.05) for r in rates]
    assert got[0] == 1.0 and got[-1] < 0.5
    assert all(a >= b for a, b in pairwise(got))


def test_kv_pressure_preempts_but_finishes_everything() -> None:
    profile = synthetic_profile(kv_bytes_per_token=1 << 16)
    limits = Limits(kv_cache_bytes=(1 << 16) * 2048)
    traffic = Traffic.of_workload("chatbot", 200, 2048, seed=2)
    colocated = Placement("colocated", colocated=Role(1, 1), limits=limits)
    for placement in (disagg(limits=limits), colocated):
        result = run(profile, placement, traffic, 20.0)
        assert np.isfinite(result.e2e).all()


def test_disagg_protects_tpot_from_long_prompts() -> None:
    """Long prompts, expensive prefill: colocated engines stall their decodes behind each prompt
    pass; split across the same two devices, decode's TPOT stays at its step time."""
    profile = synthetic_profile(
        prefill=PrefillFit(0.01, 1e-3, 0.0), decode=DecodeFit((DecodeRange(1, 0.02, 2e-4, 0.0),))
    )
    traffic = Traffic.of_workload("summarization", 200, 4096, seed=4)
    colocated = Placement("colocated", colocated=Role(2, 1))
    split = run(profile, disagg(limits=Limits()), traffic, 0.3)
    mixed = run(profile, colocated, traffic, 0.3)
    split_p90, mixed_p90 = (float(np.nanpercentile(r.tpot, 90)) for r in (split, mixed))
    assert split_p90 < 0.025 and mixed_p90 > 0.035
    assert split.attainment(10.0, 0.03) > 0.9 > mixed.attainment(10.0, 0.03)


def test_colocated_single_request_pays_prefill_decode_and_serving_costs() -> None:
    profile = synthetic_profile(
        prefill=PrefillFit(0.01, 1e-4, 0.0),
        decode=DecodeFit((DecodeRange(1, 0.02, 0.0, 0.0),)),
        serving=ServingOverhead(token_s=0.001, request_s=0.05),
    )
    placement = Placement("colocated", colocated=Role(1, 1))
    result = run(profile, placement, Traffic(((100, 10),), "fixed"), 1.0)
    assert result.ttft[0] == pytest.approx(0.05 + 0.01 + 100 * 1e-4 + 0.001)
    assert result.tpot[0] == pytest.approx(0.021)


def test_a_streamed_token_costs_a_cpu_step_once_per_core_of_the_instance() -> None:
    """Same fits at 1 and 2 cores: the 2-core instance pays the per-token cost twice (the other
    threads' work stalls its whole OpenMP team); on GPUs once."""
    serving = ServingOverhead(token_s=0.001)
    decode = DecodeFit((DecodeRange(1, 0.02, 0.0, 0.0),))
    traffic = Traffic(((100, 10),), "fixed")
    for device, per_token in (("cpu", 0.002), ("gpu", 0.001)):
        profile = synthetic_profile(decode=decode, units=(1, 2), serving=serving, device=device)
        wide = run(profile, Placement("colocated", colocated=Role(1, 2)), traffic, 1.0)
        assert wide.tpot[0] == pytest.approx(0.02 + per_token)


def test_a_pool_larger_than_the_run_needs_simulates_like_one_just_big_enough(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The simulated pool is capped at what every request of the run holds at once; a larger
    pool refuses no block either, so the run is the same."""
    profile = synthetic_profile()
    traffic = Traffic.of_workload("chatbot", 60, 2048, seed=6)
    need = pool_blocks(profile, Limits().kv_cache_bytes, traffic.lengths)
    assert need == sum(-(-(i + o) // 16) for i, o in traffic.lengths)
    for mode in ("disagg", "colocated"):
        capped = run(profile, placement(mode, Limits()), traffic, 8.0)
        with monkeypatch.context() as patch:
            patch.setattr(simulate, "pool_blocks", lambda *_: 4 * need)
            larger = run(profile, placement(mode, Limits()), traffic, 8.0)
        np.testing.assert_array_equal(capped.ttft, larger.ttft)
        np.testing.assert_array_equal(capped.e2e, larger.e2e)
