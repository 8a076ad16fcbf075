"""Profiles: JSON round trip, the modelled GPU profile, and a real (quick) profile of ``tiny``.

``synthetic_profile`` is imported by the other planner tests: known step times, no measurement.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from splitserve.model.tiny import tiny_config
from splitserve_tools.cli import main as cli_main
from splitserve_tools.planner import profile_cache
from splitserve_tools.planner.fit import DecodeFit, DecodeRange, HandoffFit, PrefillFit
from splitserve_tools.planner.gpu_model import H200, modelled_profile
from splitserve_tools.planner.measure import Points
from splitserve_tools.planner.profile import (
    Contention,
    ModelShape,
    Profile,
    ServingOverhead,
    UnitProfile,
    with_costs_of,
)


def synthetic_profile(
    prefill: PrefillFit | None = None,
    decode: DecodeFit | None = None,
    units: tuple[int, ...] = (1,),
    kv_bytes_per_token: int = 1024,
    device: str = "cpu",
    serving: ServingOverhead | None = None,
) -> Profile:
    """The same fits at every instance size (units change nothing: tests choose the counts)."""
    unit = UnitProfile(
        threads=1,
        prefill=prefill or PrefillFit(0.005, 1e-4, 0.0),
        decode=decode or DecodeFit((DecodeRange(1, 0.02, 1e-3, 1e-6),)),
    )
    return Profile(
        model="synthetic",
        device=device,
        dtype="float32",
        modelled=True,
        hardware={"cpu": "synthetic", "gpu_memory_bytes": 1 << 34},
        shape=ModelShape(kv_bytes_per_token, 16, 4096, 1 << 20),
        handoff=HandoffFit(1e-4, 1e10),
        units=dict.fromkeys(units, unit),
        serving=serving or ServingOverhead(),
    )


def test_profile_json_round_trip(tmp_path: Path) -> None:
    profile = synthetic_profile(units=(1, 2), serving=ServingOverhead(3e-4, 1e-3, 1.1, 1.2))
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == profile


def test_modelled_h200_profile_is_labelled_and_sane() -> None:
    profile = modelled_profile(tiny_config(), "tiny", "bfloat16")
    assert profile.modelled and profile.device == "gpu"
    assert profile.hardware["modelled_from"]["memory_bandwidth"] == H200.memory_bandwidth
    unit = profile.unit(1)
    # A decode step of one sequence costs at least one read of the weights at full bandwidth.
    assert unit.decode(1, 100) >= profile.shape.weight_bytes * 0.5 / H200.memory_bandwidth
    assert unit.decode(64, 64 * 1000) > unit.decode(1, 1000)
    assert unit.prefill(4096, 4096**2) > unit.prefill(128, 128**2)


def test_quick_profile_of_tiny_through_the_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "tiny.json"
    monkeypatch.setenv("SPLITSERVE_PROFILE_CACHE", str(tmp_path / "cache"))
    cli_main(["plan", "profile", "--model", "tiny", "--quick", "--no-progress", "--out", str(out)])
    profile = Profile.load(out)
    # A --quick profile checks the path: not cached for `serve` to plan from.
    assert profile_cache.lookup("tiny", "float32", "cpu")[0] is None
    assert not profile.modelled and profile.device == "cpu"
    assert list(profile.units) == [len(os.sched_getaffinity(0))]
    unit = next(iter(profile.units.values()))
    assert len(unit.prefill_samples) == 4 and len(unit.decode_samples) == 4
    assert all(s.seconds > 0 for s in unit.prefill_samples + unit.decode_samples)
    assert min(unit.prefill.a, unit.prefill.b, unit.prefill.c) >= 0
    assert profile.shape.kv_bytes_per_token == 2 * 4 * 4 * 32 * 4  # 2·layers·kv heads·dim·fp32
    assert profile.handoff.bytes_per_s > 0
    assert profile.hardware["logical_cpus"] == os.cpu_count()
    assert unit.rates is not None
    assert min(unit.rates.read_bytes_per_s, unit.rates.matmul_flops) > 0
    ceiling = tmp_path / "ceiling.json"
    cores = str(next(iter(profile.units)))
    flags = ["--workload", "chatbot", "--tpot-slo", "0.1", "--cores", cores, "--json", str(ceiling)]
    flags += ["--measured", "llm=1.5", "--num-requests", "50", "--max-model-len", "256"]
    flags += ["--plot", str(tmp_path / "ceiling.png")]
    cli_main(["plan", "ceiling", "--profile", str(out), *flags])
    doc = json.loads(ceiling.read_text())
    assert set(doc["ceilings"]) == {"engine", "roofline"}
    assert all(c["shared_rps"] > 0 for c in doc["ceilings"].values())
    assert (tmp_path / "ceiling.png").stat().st_size > 0


def test_profile_pinned_to_one_core(tmp_path: Path) -> None:
    out = tmp_path / "one.json"
    args = ["--model", "tiny", "--quick", "--no-progress", "--cores", "1", "--out", str(out)]
    cli_main(["plan", "profile", *args])
    profile = Profile.load(out)
    assert list(profile.units) == [1] and profile.units[1].threads == 1
    # A calibrated profile of this machine lends its serving costs to a new profile.
    costs = ServingOverhead(4e-4, 2e-3, 1.2, 1.3)
    calibrated = dataclasses.replace(profile, serving=costs, contention=Contention(0.1, 0.2))
    calibrated_path = tmp_path / "calibrated.json"
    calibrated.save(calibrated_path)
    again = tmp_path / "again.json"
    cli_main(["plan", "profile", *args[:-1], str(again), "--costs-from", str(calibrated_path)])
    got = Profile.load(again)
    assert got.serving == costs and got.contention == Contention(0.1, 0.2)


def test_costs_come_only_from_a_profile_of_the_same_machine() -> None:
    mine = synthetic_profile()
    other = dataclasses.replace(
        synthetic_profile(serving=ServingOverhead(1e-3)), contention=Contention(0.3, 0.1)
    )
    moved = with_costs_of(mine, other)
    assert moved.serving == other.serving and moved.contention == other.contention
    assert moved.units == mine.units
    elsewhere = dataclasses.replace(other, hardware={"cpu": "else", "cpu_id": {"model": "1"}})
    with pytest.raises(ValueError, match="another machine"):
        with_costs_of(mine, elsewhere)


def test_points_context_holds_the_longest_prompt_and_its_output() -> None:
    points = Points(prefill_lengths=(16, 1024), decode_contexts=(64,), decode_steps=8)
    assert points.max_len == 1025
    assert Points(prefill_lengths=(16,), decode_contexts=(512,)).max_len == 512 + 8 + 2
