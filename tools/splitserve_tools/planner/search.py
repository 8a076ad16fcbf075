"""Goodput of a placement on the simulator, and the search over placements.

Goodput is DistServe's: the highest rate at which ``attainment`` of the requests meet both
SLOs, found by the search the bench uses too (``splitserve_tools.workload.search``) over
simulated runs: from a first guess in a wide range, doubling or halving the rate until the
answer changes, then bisecting geometrically to ``rel_tol``. Placements use exactly the
devices given (cores or GPUs); they are ranked by goodput per device, so budgets of different
sizes compare. The search runs in two rounds: every split of the devices with the default
batching limits, then the batching limits on the best splits of each mode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from tqdm import tqdm

from splitserve_tools.planner.placement import Limits, Placement, Role
from splitserve_tools.planner.profile import Profile
from splitserve_tools.planner.simulate import Traffic, run
from splitserve_tools.workload.search import SearchSettings, find_goodput
from splitserve_tools.workload.slo import SLO


@dataclass(frozen=True)
class Candidate:
    placement: Placement
    goodput_rps: float
    curve: tuple[tuple[float, float], ...]
    """(rate, attainment) of every simulated run, by rate."""
    prefix_hit_rate: float = 0.0
    """Of the prompt tokens looked up in the prefix caches, the share they served, in the run
    at the goodput (the lowest rate probed where nothing passed)."""

    @property
    def per_device(self) -> float:
        return self.goodput_rps / self.placement.devices


def goodput(
    profile: Profile,
    placement: Placement,
    traffic: Traffic,
    slo: SLO,
    first_rate: float = 1.0,
    rel_tol: float = 0.02,
    min_rate: float = 1e-3,
    max_rate: float = 1e5,
) -> Candidate:
    """Goodput within [``min_rate``, ``max_rate``]: ``max_rate`` if it passes there, 0 if
    nothing from ``min_rate`` up passes."""
    settings = SearchSettings(min_rate, max_rate, start=first_rate, rel_tol=rel_tol)
    hits: dict[float, float] = {}

    def attained(rate: float) -> float:
        result = run(profile, placement, traffic, rate)
        hits[rate] = result.prefix_hit_rate
        return result.attainment(slo.ttft_s, slo.tpot_s)

    found = find_goodput(attained, slo.attainment, settings)
    curve = tuple(sorted(dict(found.probes).items()))
    hit = hits.get(found.goodput_rps, hits[min(hits)])
    return Candidate(placement, found.goodput_rps, curve, hit)


def splits(profile: Profile, devices: int) -> list[Placement]:
    """Every placement using exactly ``devices`` with the profile's instance sizes."""
    sizes = sorted(profile.units)
    out = [
        Placement("colocated", colocated=Role(devices // u, u)) for u in sizes if devices % u == 0
    ]
    for up in sizes:
        for ud in sizes:
            for n_p in range(1, devices // up + 1):
                rest = devices - n_p * up
                if rest >= ud and rest % ud == 0:
                    out.append(
                        Placement("disagg", prefill=Role(n_p, up), decode=Role(rest // ud, ud))
                    )
    return out


def limit_variants(placement: Placement, base: Limits) -> list[Limits]:
    seqs = sorted({base.max_num_seqs, 32, 128})
    if placement.mode == "disagg":
        return [
            dataclasses.replace(base, prefill_max_batch_size=b, max_num_seqs=s)
            for b in sorted({base.prefill_max_batch_size, 1, 4, 16})
            for s in seqs
        ]
    chunked = [(False, base.max_num_batched_tokens), (True, 512), (True, 2048)]
    return [
        dataclasses.replace(base, chunked_prefill=c, max_num_batched_tokens=t, max_num_seqs=s)
        for c, t in chunked
        for s in seqs
    ]


def _evaluate(
    profile: Profile,
    placements: Iterable[Placement],
    traffic: Traffic,
    slo: SLO,
    progress: bool,
    desc: str,
) -> list[Candidate]:
    items = list(placements)
    return [goodput(profile, p, traffic, slo) for p in tqdm(items, desc=desc, disable=not progress)]


def rank(candidates: Iterable[Candidate]) -> list[Candidate]:
    return sorted(candidates, key=lambda c: (-c.per_device, -c.goodput_rps, c.placement.devices))


def search(
    profile: Profile,
    traffic: Traffic,
    slo: SLO,
    devices: int,
    base: Limits,
    top_splits: int = 2,
    progress: bool = True,
) -> list[Candidate]:
    """Every placement tried, best first."""
    shapes = [dataclasses.replace(p, limits=base) for p in splits(profile, devices)]
    if not shapes:
        raise ValueError(
            f"no placement fits {devices} {profile.unit_name} with instance sizes "
            f"{sorted(profile.units)}"
        )
    first = rank(_evaluate(profile, shapes, traffic, slo, progress, "splits"))
    tuned: list[Placement] = []
    for mode in ("disagg", "colocated"):
        for cand in [c for c in first if c.placement.mode == mode][:top_splits]:
            tuned += [
                dataclasses.replace(cand.placement, limits=lim)
                for lim in limit_variants(cand.placement, base)
                if lim != base
            ]
    second = _evaluate(profile, tuned, traffic, slo, progress, "batching limits")
    return rank([*first, *second])


def default_placement(profile: Profile, devices: int, base: Limits) -> Placement:
    """The hand-picked layout of ``splitserve serve`` without a plan, as far as the simulator
    can hold it: CPU, one prefill instance on the first half of the cores and one decode
    instance on the rest; GPU, half of the GPUs prefill and the rest decode, one instance each."""
    half = max(1, devices // 2)
    if devices < 2:
        raise ValueError("the default disaggregated layout needs 2 devices or more")
    if profile.device == "gpu":
        prefill, decode = Role(half, 1), Role(devices - half, 1)
    else:
        prefill, decode = Role(1, half), Role(1, devices - half)
    for role in (prefill, decode):
        profile.unit(role.units)
    return Placement("disagg", prefill=prefill, decode=decode, limits=base)
