"""The simulator on session workloads: later turns wait for earlier ones, prompts share what
the bench's prompts share, and the engine's prefix cache prices cached tokens."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_planner_profile import synthetic_profile

from splitserve_tools.planner.fit import DecodeFit, DecodeRange, HandoffFit, PrefillFit
from splitserve_tools.planner.placement import Limits, Placement, Role
from splitserve_tools.planner.search import goodput
from splitserve_tools.planner.simulate import Traffic, run, session_requests, simulate
from splitserve_tools.planner.step_model import StepModel
from splitserve_tools.workload.sessions import probe_turns, session_turns
from splitserve_tools.workload.slo import SLO

PROFILE = synthetic_profile(
    prefill=PrefillFit(0.002, 2e-4, 1e-8),
    decode=DecodeFit((DecodeRange(1, 0.005, 1e-4, 1e-7),)),
)
DISAGG = Placement("disagg", prefill=Role(1, 1), decode=Role(1, 1))
COLOCATED = Placement("colocated", colocated=Role(1, 1))
TRAFFIC = Traffic.of_workload("multi-turn", 40, 2048, seed=1)


def _no_cache(placement: Placement) -> Placement:
    return dataclasses.replace(placement, limits=Limits(prefix_cache=False))


def test_session_prompts_share_exactly_what_the_bench_prompts_share() -> None:
    turns = session_turns("multi-turn", 30, 2048, seed=2)
    reqs = session_requests(turns, 2.0, "poisson", 0, 1.0)
    system = turns[0].segments[0]
    for turn, req in zip(turns, reqs, strict=True):
        assert req.prompt is not None and len(req.prompt) == req.input_len == turn.input_len
        assert req.prompt[:system] == reqs[0].prompt[:system]  # type: ignore[index]
        if turn.follows is None:
            assert np.isfinite(req.arrival)
            if turn.session:  # another session's message differs right after the system prompt
                assert req.prompt[system] not in reqs[0].prompt[system:]  # type: ignore[index]
        else:
            earlier = reqs[turn.follows].prompt
            assert earlier is not None and req.prompt[: len(earlier)] == earlier
            assert req.follows == turn.follows and np.isnan(req.arrival)


def test_a_later_turn_is_sent_think_s_after_the_turn_before_it_ended() -> None:
    reqs, _ = simulate(PROFILE, DISAGG, TRAFFIC.requests_at(1.0))
    later = [r for r in reqs if r.follows is not None]
    assert later
    for r in later:
        assert r.arrival == pytest.approx(reqs[r.follows].last + r.think_s)  # type: ignore[index]
        assert r.first > r.arrival


def test_a_session_run_sends_a_minute_of_turns_like_the_bench() -> None:
    assert len(TRAFFIC.requests_at(0.5)) == 40
    assert len(TRAFFIC.requests_at(3.0)) == probe_turns(40, 3.0) == 180


def test_cached_tokens_cost_only_their_attention_reads() -> None:
    model = StepModel(
        PROFILE.unit(1).prefill, PROFILE.unit(1).decode, HandoffFit(1e-4, 1e10), 1024, 16, 0.0
    )
    full = model.prompt_pass([512, 256])
    assert model.prompt_pass([512, 256], [0, 0]) == full
    half = model.prompt_pass([512, 256], [256])
    fit = PROFILE.unit(1).prefill
    assert half == pytest.approx(fit(256 + 256, 256 * 256 + 2 * 256 * 256 + 256 * 256))
    assert half < full


@pytest.mark.parametrize("placement", [DISAGG, COLOCATED], ids=["disagg", "colocated"])
def test_the_prefix_cache_serves_later_turns(placement: Placement) -> None:
    on = run(PROFILE, placement, TRAFFIC, 1.0)
    off = run(PROFILE, _no_cache(placement), TRAFFIC, 1.0)
    assert off.prefix_hit_rate == 0.0
    assert 0.4 < on.prefix_hit_rate < 1.0
    reqs = TRAFFIC.requests_at(1.0)
    later = np.array([r.follows is not None for r in reqs])
    assert np.nanmedian(on.ttft[later]) < 0.7 * np.nanmedian(off.ttft[later])


def test_prompts_of_their_own_never_hit() -> None:
    traffic = Traffic.of_workload("chatbot", 30, 2048, seed=3)
    assert run(PROFILE, COLOCATED, traffic, 1.0).prefix_hit_rate == 0.0


def test_goodput_reports_the_hit_rate_of_its_run() -> None:
    slo = SLO(0.5, 0.05)
    found = goodput(PROFILE, COLOCATED, TRAFFIC, slo, rel_tol=0.1)
    assert found.goodput_rps > 0 and found.prefix_hit_rate > 0.4
    assert goodput(PROFILE, _no_cache(COLOCATED), TRAFFIC, slo, rel_tol=0.1).prefix_hit_rate == 0
