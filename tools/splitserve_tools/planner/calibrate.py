"""Fitting what the engine profile cannot see, from runs of the real server.

The profile times each instance alone. Served, an instance pays for the pipeline around the
engine and for its neighbours: cores share memory bandwidth and caches, and tritonserver's and
the client's threads run on them too. Two runs through one placement measure both:

- one prompt length, one request at a time: median TTFT minus the profiled prefill of that
  prompt is ``request_s`` (parsing, tokenizing, the BLS call, the first response);
- open-loop traffic (of the workload to plan for) that keeps both phases busy: the contention
  factors are the grid point whose simulation of the very same requests (same lengths, same
  arrival times) comes closest to the measured mean TTFT and mean TPOT, in squared log ratio.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from splitserve_tools.planner.placement import Placement, Role
from splitserve_tools.planner.profile import Contention, Profile
from splitserve_tools.planner.simulate import Traffic, run

GRID = tuple(round(0.05 * i, 2) for i in range(13))
"""Contention factors tried, for prefill and for decode: 0 to 60 % longer steps."""


@dataclass(frozen=True)
class Observed:
    """One run as the bench recorded it: per request, in arrival order."""

    rate: float
    lengths: tuple[tuple[int, int], ...]
    ttft: np.ndarray
    tpot: np.ndarray

    @classmethod
    def from_bench_run(cls, run: dict[str, Any]) -> Observed:
        """A ``runs[i]`` entry of ``splitserve bench --json``."""
        reqs = run["requests"]
        if any(r["error"] for r in reqs):
            raise ValueError("a calibration run had errors: its timings say nothing")
        nan = math.nan
        return cls(
            rate=float(run["rate"]),
            lengths=tuple((int(r["input_len"]), int(r["output_len"])) for r in reqs),
            ttft=np.array([nan if r["ttft"] is None else r["ttft"] for r in reqs], float),
            tpot=np.array([nan if r["tpot"] is None else r["tpot"] for r in reqs], float),
        )


def _prompt_role(placement: Placement) -> Role:
    """The role whose instances run the prompt passes."""
    role = placement.prefill or placement.colocated
    assert role is not None
    return role


def loaded_rate(
    profile: Profile, placement: Placement, input_lens: Sequence[int], busy: float
) -> float:
    """The rate at which prompts of these lengths keep the placement's prefill instances
    ``busy`` (a fraction) by the profile: load enough that both phases run side by side most
    of the time, little enough that queues stay short."""
    role = _prompt_role(placement)
    fit = profile.unit(role.units).prefill
    mean_s = float(np.mean([fit(n, n * n) for n in input_lens]))
    return busy * role.instances / mean_s


def fit_request_s(profile: Profile, placement: Placement, alone: Observed) -> float:
    """Median TTFT of requests that had the server to themselves, less their profiled prefill
    (never below zero)."""
    fit = profile.unit(_prompt_role(placement).units).prefill
    extra = [t - fit(n, n * n) for t, (n, _) in zip(alone.ttft, alone.lengths, strict=True)]
    return max(0.0, float(np.nanmedian(extra)))


def _log_error(simulated: np.ndarray, measured: np.ndarray) -> float:
    return math.log(float(np.nanmean(simulated)) / float(np.nanmean(measured))) ** 2


def fit_contention(
    profile: Profile,
    placement: Placement,
    loaded: Observed,
    seed: int,
    arrival: str = "poisson",
    grid: Sequence[float] = GRID,
) -> tuple[Contention, float]:
    """The factors that best reproduce ``loaded`` (TTFT and TPOT weigh the same), and their
    error: the root of the summed squared log ratios (0.1 is ~10 % off)."""
    traffic = Traffic(loaded.lengths, arrival, seed=seed)
    best = (math.inf, Contention())
    for p in grid:
        for d in grid:
            trial = replace(profile, contention=Contention(p, d))
            sim = run(trial, placement, traffic, loaded.rate)
            err = _log_error(sim.ttft, loaded.ttft) + _log_error(sim.tpot, loaded.tpot)
            if err < best[0]:
                best = (err, trial.contention)
    return best[1], math.sqrt(best[0])
