"""Profiles at several instance sizes: one subprocess per core count, pinned to that many cores
(``sched_setaffinity`` and ``torch.set_num_threads``), so an instance of ``k`` cores is timed as
it will run. Run as ``python -m splitserve_tools.planner.cores`` it is that subprocess."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from splitserve_tools.planner.cpu_id import cpu_identity, cpu_label
from splitserve_tools.planner.fit import HandoffFit
from splitserve_tools.planner.measure import Points, measure_handoff, measure_unit, model_shape
from splitserve_tools.planner.profile import ModelShape, Profile, ServingOverhead, UnitProfile


def hardware(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu": cpu_label(identity := cpu_identity()),
        "cpu_id": identity,
        "logical_cpus": os.cpu_count(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "machine": platform.machine(),
        "torch": torch.__version__,
    }
    if device == "gpu" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_bytes=props.total_memory)
        info["gpu_count"] = torch.cuda.device_count()
    return info


@dataclasses.dataclass(frozen=True)
class Measured:
    unit: UnitProfile
    shape: ModelShape
    handoff: HandoffFit | None


def measure_here(
    model: str, dtype: str, device: str, points: Points, handoff: bool, progress: bool, desc: str
) -> Measured:
    unit, parts = measure_unit(model, dtype, device, points, progress, desc)
    shape = model_shape(parts, parts.model.cfg.max_position_embeddings)
    return Measured(unit, shape, measure_handoff(parts.layout, device) if handoff else None)


def _pinned(
    model: str, dtype: str, points: Points, cores: list[int], handoff: bool, progress: bool
) -> Measured:
    with tempfile.TemporaryDirectory(prefix="splitserve-profile-") as tmp:
        out = Path(tmp) / "unit.json"
        cmd = [
            sys.executable, "-m", "splitserve_tools.planner.cores",
            "--model", model, "--dtype", dtype, "--out", str(out),
            "--cores", ",".join(map(str, cores)),
            "--points", json.dumps(dataclasses.asdict(points)),
        ]  # fmt: skip
        if handoff:
            cmd.append("--handoff")
        if not progress:
            cmd.append("--no-progress")
        subprocess.run(cmd, check=True)
        d = json.loads(out.read_text())
    return Measured(
        UnitProfile.from_dict(d["unit"]),
        ModelShape(**d["shape"]),
        HandoffFit.from_dict(d["handoff"]) if d["handoff"] else None,
    )


def profile_cpu(
    model: str,
    dtype: str,
    points: Points,
    core_counts: list[int] | None = None,
    serving: ServingOverhead | None = None,
    progress: bool = True,
) -> Profile:
    """``core_counts`` None: this process as it is (one instance size, its affinity); else one
    pinned subprocess per count, on the first cores of this process's affinity."""
    mine = sorted(os.sched_getaffinity(0))
    results: dict[int, Measured] = {}
    if core_counts is None:
        torch.set_num_threads(len(mine))
        results[len(mine)] = measure_here(model, dtype, "cpu", points, True, progress, "profile")
    else:
        for i, k in enumerate(sorted(set(core_counts))):
            if not 0 < k <= len(mine):
                raise ValueError(f"cannot profile {k} cores: this process may use {len(mine)}")
            results[k] = _pinned(model, dtype, points, mine[:k], i == 0, progress)
    first = next(iter(results.values()))
    handoff = next(m.handoff for m in results.values() if m.handoff is not None)
    return Profile(
        model=model,
        device="cpu",
        dtype=dtype,
        modelled=False,
        hardware=hardware("cpu"),
        shape=first.shape,
        handoff=handoff,
        units={k: m.unit for k, m in results.items()},
        serving=serving or ServingOverhead(),
    )


def profile_gpu(
    model: str,
    dtype: str,
    points: Points,
    serving: ServingOverhead | None = None,
    progress: bool = True,
) -> Profile:
    """One GPU per instance (the engine has no tensor parallelism), measured on GPU 0."""
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device here: build a modelled profile instead (--modelled)")
    m = measure_here(model, dtype, "cuda", points, True, progress, "profile GPU 0")
    assert m.handoff is not None
    return Profile(
        model=model,
        device="gpu",
        dtype=dtype,
        modelled=False,
        hardware=hardware("gpu"),
        shape=m.shape,
        handoff=m.handoff,
        units={1: m.unit},
        serving=serving or ServingOverhead(),
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="profile the engine pinned to a set of cores")
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", required=True)
    ap.add_argument("--cores", required=True, help="comma-separated core ids")
    ap.add_argument("--points", required=True, help="Points as JSON")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--handoff", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    cores = [int(c) for c in args.cores.split(",")]
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    raw = json.loads(args.points)
    points = Points(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
    m = measure_here(
        args.model, args.dtype, "cpu", points, args.handoff, not args.no_progress,
        f"profile {len(cores)} core(s)",
    )  # fmt: skip
    result = {
        "unit": m.unit.to_dict(),
        "shape": dataclasses.asdict(m.shape),
        "handoff": m.handoff.to_dict() if m.handoff else None,
    }
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
