"""Goodput search on the simulator, and the choice between placements."""

from __future__ import annotations

from test_planner_profile import synthetic_profile

from splitserve_tools.planner.fit import DecodeFit, DecodeRange, PrefillFit
from splitserve_tools.planner.placement import Limits, Placement, Role
from splitserve_tools.planner.search import default_placement, goodput, search, splits
from splitserve_tools.planner.simulate import Traffic, run
from splitserve_tools.workload.slo import SLO

TRAFFIC = Traffic.of_workload("chatbot", 120, 2048, seed=0)


def test_goodput_is_the_edge_of_the_attainment_target() -> None:
    profile = synthetic_profile()
    placement = Placement("disagg", prefill=Role(1, 1), decode=Role(1, 1))
    slo = SLO(1.0, 0.05)
    found = goodput(profile, placement, TRAFFIC, slo)
    assert found.goodput_rps > 0
    assert run(profile, placement, TRAFFIC, found.goodput_rps).attainment(1.0, 0.05) >= 0.9
    failing = [rate for rate, att in found.curve if att < 0.9]
    assert failing and min(failing) <= found.goodput_rps * 1.03


def test_impossible_slo_has_zero_goodput() -> None:
    profile = synthetic_profile()
    placement = Placement("colocated", colocated=Role(1, 1))
    assert goodput(profile, placement, TRAFFIC, SLO(0.001, 0.001)).goodput_rps == 0.0


def test_splits_use_exactly_the_budget() -> None:
    profile = synthetic_profile(units=(1, 2))
    got = {p.describe() for p in splits(profile, 3)}
    assert all(p.devices == 3 for p in splits(profile, 3))
    assert "disagg: prefill 1x1, decode 1x2 units (pbatch 8, seqs 256)" in got
    assert "disagg: prefill 2x1, decode 1x1 units (pbatch 8, seqs 256)" in got
    assert "colocated: colocated 3x1 units (seqs 256)" in got


def test_search_gives_prefill_the_devices_when_prompts_dominate() -> None:
    """Prompt passes cost 3 ms a token, decode steps are cheap: in colocated engines every
    prompt stalls the running streams past the TPOT target, and one prefill instance cannot
    keep up; two prefill instances feeding one decode instance beat every other split."""
    profile = synthetic_profile(
        prefill=PrefillFit(0.01, 3e-3, 0.0),
        decode=DecodeFit((DecodeRange(1, 0.02, 1e-3, 0.0),)),
    )
    ranked = search(profile, TRAFFIC, SLO(3.0, 0.05), 3, Limits(), progress=False)
    best = ranked[0].placement
    assert best.mode == "disagg"
    assert best.prefill == Role(2, 1) and best.decode == Role(1, 1)
    assert ranked[0].per_device == ranked[0].goodput_rps / 3
    assert [c.per_device for c in ranked] == sorted((c.per_device for c in ranked), reverse=True)


def test_default_placement_halves_the_cores() -> None:
    profile = synthetic_profile(units=(1, 2))
    placement = default_placement(profile, 4, Limits())
    assert placement.prefill == Role(1, 2) and placement.decode == Role(1, 2)
