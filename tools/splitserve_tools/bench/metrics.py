"""Latency percentiles and SLO attainment over the records of one run."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from splitserve_client.stream import RequestRecord
from splitserve_tools.workload.slo import SLO, attainment

PERCENTILES = (50, 90, 99)


def failed(record: RequestRecord) -> bool:
    return record.error is not None or not record.token_times


def records_attainment(records: Sequence[RequestRecord], slo: SLO) -> float:
    """Share of all requests (failures included) that met both SLOs."""
    return attainment(
        [r.ttft for r in records], [r.tpot for r in records], [not failed(r) for r in records], slo
    )


def percentiles(values: Sequence[float]) -> dict[int, float]:
    """p50/p90/p99 of the finite values; NaN when there are none."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return dict.fromkeys(PERCENTILES, math.nan)
    return {p: float(np.percentile(finite, p)) for p in PERCENTILES}


@dataclass(frozen=True)
class Summary:
    """One run at one rate, latencies in seconds over the requests that succeeded."""

    num_requests: int
    errors: int
    attainment: float
    ttft: dict[int, float]
    tpot: dict[int, float]
    e2e: dict[int, float]
    output_tokens_per_s: float
    requests_per_s: float
    """Sent over the run's duration: below the probed rate where later turns wait on earlier
    ones or the run's tail outlasts its arrivals."""

    def flat(self) -> dict[str, float | int]:
        """``ttft_p50``, ``tpot_p99``, ... as plain keys, with the counts and attainment."""
        out: dict[str, float | int] = {
            "num_requests": self.num_requests,
            "errors": self.errors,
            "attainment": self.attainment,
            "output_tokens_per_s": self.output_tokens_per_s,
            "requests_per_s": self.requests_per_s,
        }
        for name, values in (("ttft", self.ttft), ("tpot", self.tpot), ("e2e", self.e2e)):
            out.update({f"{name}_p{p}": v for p, v in values.items()})
        return out


def summarize(records: Sequence[RequestRecord], slo: SLO, duration_s: float) -> Summary:
    ok = [r for r in records if not failed(r)]
    tokens = sum(len(r.token_times) for r in ok)
    return Summary(
        num_requests=len(records),
        errors=len(records) - len(ok),
        attainment=records_attainment(records, slo),
        ttft=percentiles([r.ttft for r in ok]),
        tpot=percentiles([r.tpot for r in ok]),
        e2e=percentiles([r.e2e for r in ok]),
        output_tokens_per_s=tokens / duration_s if duration_s > 0 else math.nan,
        requests_per_s=len(records) / duration_s if duration_s > 0 else math.nan,
    )
