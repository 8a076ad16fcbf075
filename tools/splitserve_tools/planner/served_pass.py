"""Fitting a served prompt pass across nodes, from a table of one-at-a-time prompts.

A prefill server on its own host runs no neighbour, so the contention factors of
``calibrate`` do not apply; what it pays over the profiled pass is its own serving (the
server's threads on the same cores) and, while it streams KV by layer, the transfers' work
(the transport's threads and the network stack on those cores). Both scale with the pass.
Cells are ``scripts/bench_multinode.py --json`` rows: the prefill server's own pass seconds
and the client's TTFT per prompt length and transfer mode.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from splitserve_tools.planner.fit import PrefillFit
from splitserve_tools.planner.profile import ServingOverhead


@dataclass(frozen=True)
class Cell:
    """One prompt length in one transfer mode: medians of prompts sent one at a time."""

    tokens: int
    streamed: bool
    pass_s: float
    ttft_s: float

    @classmethod
    def from_row(cls, row: dict[str, Any], stream_min_tokens: int) -> Cell:
        """A ``bench_multinode.py`` row; its prompt streamed if its mode is ``layerwise*``
        and it is no shorter than the prefill server's ``kv_stream_min_tokens``, or ``push*``
        (every pushed prompt moves by layer)."""
        tokens = int(row["tokens"])
        mode = str(row["mode"])
        streamed = mode.startswith("push") or (
            mode.startswith("layerwise") and tokens >= stream_min_tokens
        )
        return cls(tokens, streamed, float(row["pass_s"]), float(row["ttft_s"]))


def fit_served_pass(
    serving: ServingOverhead, fit: PrefillFit, cells: Sequence[Cell]
) -> ServingOverhead:
    """``serving`` with the pass factors and the per-request time fitted to ``cells`` (medians,
    so one slow cell does not move them): ``pass_factor`` from the cells that did not stream,
    ``stream_pass_factor`` from those that did (over ``pass_factor``), ``request_s`` from TTFT
    less the pass. A factor with no cell to fit it stays as it was."""
    if not cells:
        raise ValueError("fitting a served pass needs at least one cell")

    def ratios(streamed: bool) -> list[float]:
        return [c.pass_s / fit(c.tokens, c.tokens**2) for c in cells if c.streamed == streamed]

    whole, streamed = ratios(False), ratios(True)
    pass_factor = statistics.median(whole) if whole else serving.pass_factor
    stream_factor = (
        statistics.median(streamed) / pass_factor if streamed else serving.stream_pass_factor
    )
    request_s = max(0.0, statistics.median(c.ttft_s - c.pass_s for c in cells))
    return replace(
        serving, request_s=request_s, pass_factor=pass_factor, stream_pass_factor=stream_factor
    )
