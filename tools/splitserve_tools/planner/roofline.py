"""Unit costs for the ceilings: from a profile's fits (this engine) and from its measured rates
alone (any engine on the same hardware: the roofline).

Roofline per instance, from the rates the profile measured with its threads or GPU
(``planner.measure.measure_rates``): memory read bandwidth and the matmul rate. A prompt of
``n`` tokens needs ``2·P·n`` matmul FLOPs (``P`` matmul parameters of the layers), the LM head
for its last token and ``2·L·heads·head_dim·n²`` for causal attention. A decode step reads the
weights once and each sequence's context, computes ``2·(P + hidden·vocab)`` FLOPs per sequence
and its attention, and takes the larger of its read and compute times. Instances share the
machine's memory bandwidth (``shared_rates``; CPU only: each GPU has its own), not its matmul
units.
"""

from __future__ import annotations

from collections.abc import Mapping

from splitserve.model.hf_config import ModelConfig
from splitserve_tools.planner.ceiling import UnitCost
from splitserve_tools.planner.gpu_model import step_work
from splitserve_tools.planner.profile import Profile, Rates, UnitProfile


def engine_costs(profile: Profile) -> dict[int, UnitCost]:
    """The profile's fits; a prefill pass's fixed cost is left out (batching amortises it)."""

    def unit(fits: UnitProfile) -> UnitCost:
        return UnitCost(
            prefill=lambda n: fits.prefill.b * n + fits.prefill.c * n * n,
            step=fits.decode,
        )

    return {size: unit(fits) for size, fits in profile.units.items()}


def shared_rates(rates: Mapping[int, Rates], devices: int) -> dict[int, Rates]:
    """Each instance size's rates when every device of the machine is busy: memory bandwidth
    is the machine's, so ``k`` of ``devices`` get at most ``k / devices`` of what the largest
    measured size reads (two cores of this machine read barely more than one)."""
    fits = [k for k in rates if k <= devices]
    if not fits:
        return {}
    whole = max(fits)
    share = rates[whole].read_bytes_per_s / whole
    return {
        k: Rates(min(rates[k].read_bytes_per_s, share * k), rates[k].matmul_flops) for k in fits
    }


def roofline_costs(cfg: ModelConfig, profile: Profile, devices: int) -> dict[int, UnitCost]:
    """For each instance size up to ``devices`` whose rates the profile has (none: an empty
    dict); on CPU at its share of the machine's bandwidth (``shared_rates``)."""
    measured = {k: u.rates for k, u in profile.units.items() if u.rates is not None}
    w = step_work(cfg, profile.dtype)

    def unit(r: Rates) -> UnitCost:
        def prefill(n: int) -> float:
            flops = 2 * w.params * n + 2 * w.lm_head + w.attention_flops * n * n
            return flops / r.matmul_flops

        def step(batch: int, context: float) -> float:
            read = (w.read_bytes + context * w.kv_bytes_per_token) / r.read_bytes_per_s
            flops = 2 * (w.params + w.lm_head) * batch + 2 * w.attention_flops * context
            return max(read, flops / r.matmul_flops)

        return UnitCost(prefill, step)

    per_size = shared_rates(measured, devices) if profile.device == "cpu" else measured
    return {k: unit(r) for k, r in per_size.items() if k <= devices}
