"""Steady-state goodput ceilings: the highest request rate some cores could sustain under a TPOT
target, as a fluid bound (seconds of work per request against seconds of cores per second).

No queueing, no serving pipeline, no interference between instances: a measured goodput can
only come near a ceiling from below in steady state. (A short run is a burst and can score
above it: the bench's fixed number of requests may end before the queue builds.)

Per instance size (cores or GPUs per instance) a :class:`UnitCost` gives what prefill costs per
prompt and what a decode step costs. A decoded token costs the least at the largest batch whose
step still fits in the TPOT target; a request needs ``output_len - 1`` of them (prefill makes
the first). From one set of unit costs:

- **shared**: each phase runs on the instance size that does it at the least cost per device,
  and the devices' time is shared between the phases perfectly (no phase waits for the other):
  ``devices / (k_p·prefill + k_d·(output_len - 1)·token)`` requests/s. No placement of the same
  engine beats it, disaggregated ones included;
- **colocated**: instances of one size, each doing both phases;
- **split**: ``p`` devices only prefill and ``d`` only decode, each side at its own ceiling;
  the rate is the smaller of the two.

Interference is left out: a colocated instance's prefills delay its decode steps, which costs
it TPOT (what disaggregation removes), so measured colocated goodput stays further below its
ceiling than disaggregated does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

PrefillCost = Callable[[int], float]
"""Seconds of one instance to prefill one prompt of this length (per-pass costs amortised)."""
StepCost = Callable[[int, float], float]
"""Seconds of one decode step for ``batch`` sequences holding ``context`` tokens in all."""

MAX_BATCH = 4096
"""Largest decode batch considered (a GPU's KV memory usually allows less)."""


@dataclass(frozen=True)
class UnitCost:
    prefill: PrefillCost
    step: StepCost


@dataclass(frozen=True)
class Lengths:
    """What the ceilings need of a workload's (input, output) lengths."""

    mean_output: float
    decode_tokens: float
    """Tokens per request that decode steps make: all but the first, which prefill makes."""
    mean_decode_context: float
    """Context per sequence of an average decode step: the step that makes token ``j`` (from
    0) of a request with prompt ``n`` reads ``n + j`` cached tokens."""
    prompts: tuple[int, ...]

    @property
    def mean_prompt(self) -> float:
        return sum(self.prompts) / len(self.prompts)

    @classmethod
    def of(cls, pairs: Sequence[tuple[int, int]]) -> Lengths:
        if not pairs:
            raise ValueError("no requests to take lengths from")
        steps = sum(o - 1 for _, o in pairs if o > 0)
        if steps == 0:
            raise ValueError("the requests need no decode step")
        context = sum((o - 1) * n + o * (o - 1) / 2 for n, o in pairs if o > 0) / steps
        count = len(pairs)
        return cls(
            sum(o for _, o in pairs) / count, steps / count, context, tuple(n for n, _ in pairs)
        )


@dataclass(frozen=True)
class TokenCost:
    seconds: float
    """Instance seconds per decoded token; ``inf`` when no batch meets the target."""
    batch: int
    """The largest batch that costs the least within the target (0 when none does)."""


def decode_token_cost(step: StepCost, context: float, tpot_s: float) -> TokenCost:
    """Cheapest instance time per token over batches whose step fits in ``tpot_s``."""
    best = TokenCost(math.inf, 0)
    for batch in range(1, MAX_BATCH + 1):
        seconds = step(batch, batch * context)
        if seconds > tpot_s:
            break
        per_token = seconds / batch
        if per_token <= best.seconds:
            best = TokenCost(per_token, batch)
    return best


@dataclass(frozen=True)
class UnitCeiling:
    size: int
    prefill_s: float
    """Instance seconds per request of prefill."""
    token: TokenCost
    prefill_rps: float
    """Requests/s one instance prefills when it does nothing else."""
    decode_rps: float
    """Requests/s one instance decodes within the target when it does nothing else."""


def unit_ceiling(size: int, cost: UnitCost, lengths: Lengths, tpot_s: float) -> UnitCeiling:
    prefill_s = sum(cost.prefill(n) for n in lengths.prompts) / len(lengths.prompts)
    token = decode_token_cost(cost.step, lengths.mean_decode_context, tpot_s)
    decode_s = lengths.decode_tokens * token.seconds
    return UnitCeiling(
        size,
        prefill_s,
        token,
        1.0 / prefill_s if prefill_s > 0 else math.inf,
        1.0 / decode_s if decode_s > 0 else math.inf,
    )


@dataclass(frozen=True)
class Ceilings:
    devices: int
    units: dict[int, UnitCeiling]
    shared_rps: float
    prefill_size: int
    """Instance size that prefills at the least cost per device (the shared bound uses it)."""
    decode_size: int
    """Instance size that decodes at the least cost per device."""
    colocated_rps: dict[int, float]
    """Instance size ``k`` dividing the devices → the ceiling of ``devices / k`` instances that
    each do both phases (the colocated mode)."""
    split_rps: dict[int, float]
    """Prefill devices ``p`` (decode gets the rest) → the split's ceiling."""


def _side(devices: int, units: Mapping[int, UnitCeiling], rate: Callable[[UnitCeiling], float]):
    return max(
        ((devices // size) * rate(u) for size, u in units.items() if devices % size == 0),
        default=0.0,
    )


def ceilings(
    costs: Mapping[int, UnitCost], lengths: Lengths, tpot_s: float, devices: int
) -> Ceilings:
    """Ceilings for ``devices`` cores (or GPUs), from the costs of each instance size that fits."""
    units = {
        size: unit_ceiling(size, cost, lengths, tpot_s)
        for size, cost in sorted(costs.items())
        if size <= devices
    }
    if not units:
        raise ValueError(f"no instance size fits in {devices} devices (have {sorted(costs)})")
    prefill = min(units, key=lambda k: k * units[k].prefill_s)
    decode = min(units, key=lambda k: k * units[k].token.seconds)
    per_request = prefill * units[prefill].prefill_s
    per_request += decode * lengths.decode_tokens * units[decode].token.seconds
    split = {
        p: min(
            _side(p, units, lambda u: u.prefill_rps),
            _side(devices - p, units, lambda u: u.decode_rps),
        )
        for p in range(1, devices)
    }
    colocated = {
        k: (devices // k) / (u.prefill_s + lengths.decode_tokens * u.token.seconds)
        for k, u in units.items()
        if devices % k == 0
    }
    shared = devices / per_request if per_request > 0 else math.inf
    return Ceilings(devices, units, shared, prefill, decode, colocated, split)
