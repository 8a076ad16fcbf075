"""What ``splitserve plan ceiling`` prints and writes: the engine's and the roofline's ceilings
side by side, and measured goodputs as fractions of them."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from splitserve_tools.planner.ceiling import Ceilings, Lengths
from splitserve_tools.planner.profile import Profile

LABEL = 36
CELL = 24


def _rps(x: float) -> str:
    if math.isnan(x):
        return "-"
    return f"{x:.2f}" if math.isfinite(x) else "inf"


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _units(profile: Profile, n: int) -> str:
    return profile.unit_name if n != 1 else profile.unit_name[:-1]


def rates_line(profile: Profile) -> str:
    parts = [
        f"{k} {_units(profile, k)}: read {u.rates.read_bytes_per_s / 1e9:.1f} GB/s, "
        f"matmul {u.rates.matmul_flops / 1e9:.0f} GFLOP/s"
        for k, u in sorted(profile.units.items())
        if u.rates is not None
    ]
    label = "datasheet rates" if profile.modelled else "measured rates"
    return f"  {label}: " + ("; ".join(parts) if parts else "none in this profile")


def _rows(profile: Profile, sources: Mapping[str, Ceilings]) -> list[tuple[str, list[str]]]:
    first = next(iter(sources.values()))
    one = _units(profile, 1)
    rows: list[tuple[str, list[str]]] = []
    for size in first.units:
        pre, dec = [], []
        for c in sources.values():
            u = c.units.get(size)
            pre.append(_rps(u.prefill_rps) if u else "-")
            dec.append(f"{_rps(u.decode_rps)} (batch {u.token.batch})" if u else "-")
        rows.append((f"one {size}-{one} instance, prefill only", pre))
        rows.append((f"one {size}-{one} instance, decode only", dec))
    rows.append(("any placement, phases sharing", [_rps(c.shared_rps) for c in sources.values()]))
    sizes = [f"{c.prefill_size} / {c.decode_size}" for c in sources.values()]
    rows.append(("  instance sizes, prefill / decode", sizes))
    for k in first.colocated_rps:
        cells = [_rps(c.colocated_rps.get(k, math.nan)) for c in sources.values()]
        rows.append((f"colocated, {k}-{one} instances", cells))
    for p in first.split_rps:
        split = [_rps(c.split_rps[p]) for c in sources.values()]
        rows.append((f"disaggregated {p} + {first.devices - p}", split))
    return rows


def ceiling_lines(
    profile: Profile,
    lengths: Lengths,
    tpot_s: float,
    sources: Mapping[str, Ceilings],
    measured: Mapping[str, float],
) -> list[str]:
    first = next(iter(sources.values()))
    lines = [
        f"steady-state ceilings on {first.devices} {profile.unit_name}, TPOT <= "
        f"{tpot_s * 1e3:.0f} ms (fluid bounds: no queueing, no serving cost, no interference)",
        f"  {len(lengths.prompts)} requests: mean prompt {lengths.mean_prompt:.0f}, mean output "
        f"{lengths.mean_output:.0f}, decode context {lengths.mean_decode_context:.0f} per sequence",
        rates_line(profile),
        "  " + "req/s".ljust(LABEL) + "".join(n.rjust(CELL) for n in sources),
    ]
    for label, cells in _rows(profile, sources):
        lines.append("  " + label.ljust(LABEL) + "".join(c.rjust(CELL) for c in cells))
    for label, rps in measured.items():
        parts = [
            f"{rps / c.shared_rps:.2f} of the {n}" if c.shared_rps > 0 else f"the {n} allows 0"
            for n, c in sources.items()
        ]
        joined = ", ".join(parts)
        lines.append(f"  measured {label} {rps:.2f} req/s: {joined} (any placement)")
    return lines


def extrapolation_lines(profile: Profile, engine: Ceilings) -> list[str]:
    """A note for each instance size whose engine decode ceiling sits at a batch past the
    largest one the profile measured: the fit is extrapolated there, and the note says which
    ``--decode-batches`` would measure it. Modelled profiles have no samples and get none."""
    lines = []
    for size, u in engine.units.items():
        unit = profile.units.get(size)
        batches = sorted({s.batch for s in unit.decode_samples}) if unit else []
        if not batches or u.token.batch <= batches[-1]:
            continue
        wanted = list(batches)
        while wanted[-1] < u.token.batch:
            wanted.append(wanted[-1] * 2)
        lines.append(
            f"  note: the engine's decode ceiling on one {size}-{_units(profile, 1)} instance is "
            f"at batch {u.token.batch}, past the largest profiled ({batches[-1]}): its fit is "
            f"extrapolated there; profile with --decode-batches {','.join(map(str, wanted))}"
        )
    return lines


def ceiling_dict(
    lengths: Lengths, tpot_s: float, sources: Mapping[str, Ceilings], measured: Mapping[str, float]
) -> dict[str, Any]:
    def one(c: Ceilings) -> dict[str, Any]:
        return {
            "devices": c.devices,
            "shared_rps": _finite(c.shared_rps),
            "prefill_size": c.prefill_size,
            "decode_size": c.decode_size,
            "colocated_rps": {str(k): _finite(r) for k, r in c.colocated_rps.items()},
            "split_rps": {str(p): _finite(r) for p, r in c.split_rps.items()},
            "units": {
                str(k): {
                    "prefill_s": u.prefill_s,
                    "prefill_rps": _finite(u.prefill_rps),
                    "decode_rps": _finite(u.decode_rps),
                    "token_s": _finite(u.token.seconds),
                    "batch": u.token.batch,
                }
                for k, u in c.units.items()
            },
        }

    return {
        "tpot_slo": tpot_s,
        "lengths": {
            "requests": len(lengths.prompts),
            "mean_prompt": lengths.mean_prompt,
            "mean_output": lengths.mean_output,
            "mean_decode_context": lengths.mean_decode_context,
        },
        "ceilings": {name: one(c) for name, c in sources.items()},
        "measured": dict(measured),
    }
