"""The cores a placement's instances share, and what sharing them costs a step.

A step's time comes from the profile, taken with nothing else running; ``Machine`` stretches
it by the profile's contention for the share of the other instances' cores that are in a step
when it starts.
"""

from __future__ import annotations

from splitserve_tools.planner.profile import Contention


class Machine:
    def __init__(self, contention: Contention, units: int) -> None:
        self.contention = contention
        self.units = units
        self.busy = 0
        """Cores (or GPUs) of the instances in a step now."""

    def step_seconds(self, units: int, prefill_s: float, decode_s: float) -> float:
        """How long a step of an instance of ``units`` takes, started now, whose prompt and
        decode parts take ``prefill_s`` and ``decode_s`` alone. Call before ``begin``."""
        others = self.units - units
        share = min(1.0, self.busy / others) if others > 0 else 0.0
        c = self.contention
        return prefill_s * (1 + c.prefill * share) + decode_s * (1 + c.decode * share)

    def begin(self, units: int) -> None:
        self.busy += units

    def end(self, units: int) -> None:
        self.busy -= units
