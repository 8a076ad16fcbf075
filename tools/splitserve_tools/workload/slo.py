"""Latency targets (DistServe's SLOs) and the share of requests that meet them."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from numpy.typing import ArrayLike


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float
    attainment: float = 0.9
    """Share of requests that must meet both targets for a run to pass."""

    def scaled(self, factor: float) -> SLO:
        """Both latency targets times ``factor``; the attainment target stays."""
        return replace(self, ttft_s=self.ttft_s * factor, tpot_s=self.tpot_s * factor)


def attainment(ttft: ArrayLike, tpot: ArrayLike, finished: ArrayLike, slo: SLO) -> float:
    """Share of the requests that finished and met both targets, per request in seconds.

    A request that never got a first token has a NaN TTFT and misses; one that produced a
    single token has a NaN TPOT, nothing to miss. No requests: none attained."""
    first = np.asarray(ttft, dtype=float)
    gaps = np.asarray(tpot, dtype=float)
    done = np.asarray(finished, dtype=bool)
    if first.size == 0:
        return 0.0
    met = done & (first <= slo.ttft_s) & (np.isnan(gaps) | (gaps <= slo.tpot_s))
    return float(np.mean(met))
