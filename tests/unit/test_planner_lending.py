"""The simulator lends cores between one prefill and one decode instance as the server does."""

from __future__ import annotations

import dataclasses

import numpy as np
from test_planner_profile import synthetic_profile

from splitserve_tools.planner.fit import DecodeFit, DecodeRange, PrefillFit
from splitserve_tools.planner.lending import Lending
from splitserve_tools.planner.placement import Limits, Placement, Role
from splitserve_tools.planner.profile import Profile, UnitProfile
from splitserve_tools.planner.simulate import Traffic, _lending, run

PASS_S = 0.1
"""A prompt pass on one core; half that on two."""


def two_core_profile() -> Profile:
    base = synthetic_profile(
        prefill=PrefillFit(PASS_S, 0.0, 0.0),
        decode=DecodeFit((DecodeRange(1, 0.02, 0.0, 0.0),)),
    )
    one = base.unit(1)
    two = UnitProfile(
        threads=2,
        prefill=PrefillFit(PASS_S / 2, 0.0, 0.0),
        decode=DecodeFit((DecodeRange(1, 0.012, 0.0, 0.0),)),
    )
    return dataclasses.replace(base, units={1: one, 2: two})


def split(limits: Limits | None = None, prefill: int = 1) -> Placement:
    return Placement(
        "disagg", prefill=Role(prefill, 1), decode=Role(1, 1), limits=limits or Limits()
    )


def test_lending_is_simulated_where_the_server_lends():
    profile = two_core_profile()
    assert isinstance(_lending(profile, split()), Lending)
    assert _lending(profile, split(Limits(lend_cores=False))) is None
    assert _lending(profile, split(prefill=2)) is None
    assert _lending(dataclasses.replace(profile, units={1: profile.unit(1)}), split()) is None
    assert _lending(dataclasses.replace(profile, device="gpu"), split()) is None


def test_an_idle_decode_lends_its_core_to_each_pass():
    """Requests one at a time: decode is idle at every pass, which runs on both cores."""
    profile = two_core_profile()
    traffic = Traffic(((16, 1),) * 5, "fixed")
    lent = run(profile, split(), traffic, 1.0)
    alone = run(profile, split(Limits(lend_cores=False)), traffic, 1.0)
    assert np.allclose(lent.ttft, PASS_S / 2, rtol=0.05)
    assert np.allclose(alone.ttft, PASS_S, rtol=0.05)


def test_lending_cuts_the_prefill_queue_while_decode_has_room():
    """Prefill at 90 % of one core, decode far inside its target: queued prompts wait less,
    every request finishes, and decode's time per token stays under its target."""
    profile = two_core_profile()
    traffic = Traffic(((16, 20),) * 600, "poisson", seed=4)
    rate = 0.9 / PASS_S
    lent = run(profile, split(), traffic, rate)
    alone = run(profile, split(Limits(lend_cores=False)), traffic, rate)
    assert np.isfinite(lent.e2e).all() and np.isfinite(alone.e2e).all()
    assert np.mean(lent.ttft) < 0.5 * np.mean(alone.ttft)
    assert np.nanmean(lent.tpot) < Limits().tpot_target_s


def test_decode_stops_lending_when_its_steps_run_late():
    """A target under decode's own step time: decode never offers while it runs requests, so
    passes that arrive while it decodes take one core."""
    profile = two_core_profile()
    traffic = Traffic(((16, 200),) * 30, "poisson", seed=5)
    strict = run(profile, split(Limits(tpot_target_s=0.001)), traffic, 2.0)
    loose = run(profile, split(), traffic, 2.0)
    assert np.median(strict.ttft) >= PASS_S  # one core, and a wait for decode's step
    assert np.median(loose.ttft) < 0.75 * np.median(strict.ttft)
