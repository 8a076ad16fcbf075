"""What ``splitserve plan profile`` and ``splitserve plan search`` do, apart from parsing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitserve_tools.planner.cores import profile_cpu, profile_gpu
from splitserve_tools.planner.gpu_model import modelled_profile
from splitserve_tools.planner.json_file import write_json
from splitserve_tools.planner.measure import Points
from splitserve_tools.planner.placement import Limits
from splitserve_tools.planner.plan import Plan
from splitserve_tools.planner.profile import Profile, ServingOverhead
from splitserve_tools.planner.search import Candidate, default_placement, goodput, search
from splitserve_tools.planner.simulate import Traffic
from splitserve_tools.workload.slo import SLO

QUICK_POINTS = Points(
    prefill_lengths=(16, 64),
    prefill_batches=(1, 2),
    decode_batches=(1, 4),
    decode_contexts=(16, 64),
    decode_steps=2,
    repeats=1,
)
"""A few seconds on the tiny model: checks the path, not a profile to plan with."""


def build_profile(
    model: str,
    device: str,
    dtype: str,
    points: Points,
    cores: list[int] | None = None,
    modelled: bool = False,
    serving: ServingOverhead | None = None,
    progress: bool = True,
) -> Profile:
    if modelled:
        if device != "gpu":
            raise ValueError("only GPU profiles can be modelled (--device gpu)")
        from splitserve.model import is_tiny
        from splitserve.model.hf_config import ModelConfig
        from splitserve.model.tiny import tiny_config

        cfg = tiny_config() if is_tiny(model) else ModelConfig.from_dir(model)
        return modelled_profile(cfg, model, dtype, serving=serving)
    if device == "gpu":
        return profile_gpu(model, dtype, points, serving, progress)
    return profile_cpu(model, dtype, points, cores, serving, progress)


def profile_lines(profile: Profile) -> list[str]:
    label = "MODELLED (datasheet rates, not measured)" if profile.modelled else "measured"
    hw = profile.hardware.get("gpu") or profile.hardware.get("cpu", "?")
    lines = [f"profile of {profile.model} ({profile.dtype}) on {hw}: {label}"]
    for n, unit in sorted(profile.units.items()):
        p = unit.prefill
        lines.append(
            f"  {n} {profile.unit_name}: prefill {p.a * 1e3:.2f} ms + {p.b * 1e6:.2f} us/token"
            f" + {p.c * 1e9:.3f} ns/token^2"
        )
        for r in unit.decode.ranges:
            lines.append(
                f"    decode from batch {r.lo}: {r.a * 1e3:.2f} ms + {r.b * 1e3:.3f} ms/seq"
                f" + {r.c * 1e6:.3f} us/context token"
            )
    h = profile.handoff
    lines.append(f"  handoff {h.fixed_s * 1e3:.3f} ms + {h.bytes_per_s / 1e9:.1f} GB/s")
    sv, c = profile.serving, profile.contention
    lines.append(
        f"  serving {sv.token_s * 1e3:.2f} ms per token, {sv.request_s * 1e3:.1f} ms per request;"
        f" steps beside busy neighbours +{c.prefill:.0%} prefill, +{c.decode:.0%} decode"
    )
    if (sv.pass_factor, sv.stream_pass_factor) != (1.0, 1.0):
        lines.append(
            f"  a served prompt pass {sv.pass_factor:.2f}x the profiled one, "
            f"{sv.stream_pass_factor:.2f}x that while it streams its KV"
        )
    return lines


@dataclass(frozen=True)
class SearchResult:
    devices: int
    ranked: list[Candidate]
    default: Candidate | None

    @property
    def best(self) -> Candidate:
        return self.ranked[0]


def default_limits(profile: Profile, kv_cache_bytes: int | None) -> Limits:
    if kv_cache_bytes is None and profile.device == "gpu":
        memory = int(profile.hardware.get("gpu_memory_bytes", 0))
        kv_cache_bytes = max(1 << 30, int(memory * 0.9) - profile.shape.weight_bytes)
    return Limits(kv_cache_bytes=kv_cache_bytes or Limits().kv_cache_bytes)


def search_budget(
    profile: Profile, traffic: Traffic, slo: SLO, devices: int, base: Limits, progress: bool
) -> SearchResult:
    ranked = search(profile, traffic, slo, devices, base, progress=progress)
    try:
        default = goodput(profile, default_placement(profile, devices, base), traffic, slo)
    except (ValueError, KeyError):
        default = None
    return SearchResult(devices, ranked, default)


def result_lines(profile: Profile, result: SearchResult, top: int) -> list[str]:
    unit = profile.unit_name
    tag = " [MODELLED profile]" if profile.modelled else ""
    lines = [f"{result.devices} {unit}{tag}: best placements by goodput per device"]
    hits = any(c.prefix_hit_rate for c in result.ranked)
    hit_head = f"  {'prefix hit':>10}" if hits else ""
    lines.append(f"  {'#':>2}  {'goodput req/s':>13}  {'per device':>10}{hit_head}  placement")
    for i, c in enumerate(result.ranked[:top], 1):
        hit = f"  {c.prefix_hit_rate:>10.2f}" if hits else ""
        lines.append(
            f"  {i:>2}  {c.goodput_rps:>13.3f}  {c.per_device:>10.3f}{hit}  "
            f"{c.placement.describe(unit)}"
        )
    if result.default is not None:
        d = result.default
        gain = result.best.goodput_rps / d.goodput_rps if d.goodput_rps > 0 else float("inf")
        lines.append(
            f"  default layout: {d.goodput_rps:.3f} req/s ({d.placement.describe(unit)}); "
            f"the planner's pick: {gain:.2f}x"
        )
    return lines


def candidate_dict(c: Candidate) -> dict[str, Any]:
    return {
        "placement": c.placement.to_dict(),
        "goodput_rps": c.goodput_rps,
        "per_device": c.per_device,
        "curve": [list(p) for p in c.curve],
        "prefix_hit_rate": c.prefix_hit_rate,
    }


def make_plan(
    profile: Profile,
    result: SearchResult,
    traffic_info: dict[str, Any],
    slo: SLO,
    max_model_len: int,
    top: int,
) -> Plan:
    best = result.best
    return Plan(
        model=profile.model,
        dtype=profile.dtype,
        device=profile.device,
        max_model_len=max_model_len,
        placement=best.placement,
        predicted_goodput_rps=best.goodput_rps,
        context={
            "traffic": traffic_info,
            "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "attainment": slo.attainment},
            "profile": {
                "model": profile.model,
                "modelled": profile.modelled,
                "hardware": profile.hardware,
            },
            "devices": result.devices,
            "default": candidate_dict(result.default) if result.default else None,
            "ranked": [candidate_dict(c) for c in result.ranked[:top]],
        },
    )


def write_results(path: Path, profile: Profile, results: Sequence[SearchResult]) -> None:
    doc = {
        "modelled": profile.modelled,
        "budgets": [
            {
                "devices": r.devices,
                "ranked": [candidate_dict(c) for c in r.ranked],
                "default": candidate_dict(r.default) if r.default else None,
            }
            for r in results
        ],
    }
    write_json(path, doc)
