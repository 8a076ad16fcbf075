"""``splitserve plan calibrate``: serve a profile's default placement on this machine, time it
with the bench, and write the profile back with the serving costs fitted to what was seen
(``splitserve_tools.planner.calibrate`` says how)."""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from splitserve_tools.bench.main import BenchOptions, bench, build_lengths
from splitserve_tools.planner.calibrate import Observed, fit_contention, fit_request_s, loaded_rate
from splitserve_tools.planner.commands import default_limits
from splitserve_tools.planner.plan import Plan
from splitserve_tools.planner.profile import Profile
from splitserve_tools.planner.search import default_placement
from splitserve_tools.planner.served_plan import Ports, served

log = logging.getLogger(__name__)

ALONE_BUSY = 0.25
"""Requests of the run that times one request at a time arrive 4 profiled prefills apart."""


@dataclass(frozen=True)
class CalibrateOptions:
    devices: int
    workload: str = "fixed"
    """Lengths of the loaded run: best those of the workload to plan for."""
    input_len: int = 512
    output_len: int = 128
    """Lengths of the run of lone requests, and of the loaded run's ``fixed`` workload."""
    num_requests: int = 150
    alone_requests: int = 8
    busy: float = 0.6
    """How busy the loaded run keeps the prefill instances, by the profile."""
    max_model_len: int = 2048
    kv_cache_bytes: int | None = None
    seed: int = 1
    """Not the bench's default (0): the loaded run's requests are not those a validation
    measures."""
    ports: Ports = field(default_factory=Ports)
    progress: bool = True


def _options(profile: Profile, opts: CalibrateOptions, **kw: object) -> BenchOptions:
    base = BenchOptions(
        targets=["llm"],
        workload=opts.workload,
        input_len=opts.input_len,
        output_len=opts.output_len,
        tokenizer=profile.model,
        max_model_len=opts.max_model_len,
        num_requests=opts.num_requests,
        seed=opts.seed,
        progress=opts.progress,
    )
    return replace(base, **kw)


def _observe(bench_opts: BenchOptions) -> Observed:
    return Observed.from_bench_run(bench(bench_opts)["runs"][0])


def calibrate(profile: Profile, opts: CalibrateOptions, work_dir: Path | None = None) -> Profile:
    """``profile`` with ``serving.request_s`` and ``contention`` measured on the real server;
    the bench reports and the server log go to ``work_dir`` (a temporary one if None)."""
    limits = default_limits(profile, opts.kv_cache_bytes)
    placement = default_placement(profile, opts.devices, limits)
    if placement.mode != "disagg":
        raise ValueError(f"calibration serves the disaggregated default; got {placement.mode}")
    max_len = min(opts.max_model_len, profile.shape.max_model_len)
    opts = replace(opts, max_model_len=max_len)
    with tempfile.TemporaryDirectory(prefix="splitserve-calibrate-") as tmp:
        work = work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        plan_path = work / "calibrate-plan.json"
        Plan(profile.model, profile.dtype, profile.device, max_len, placement, 0.0).save(plan_path)
        loaded_opts = _options(profile, opts, json_path=work / "calibrate-loaded.json")
        lengths = [n for n, _ in build_lengths(loaded_opts)]
        rate = loaded_rate(profile, placement, lengths, opts.busy)
        spaced = loaded_rate(profile, placement, [opts.input_len], ALONE_BUSY)
        alone_opts = _options(
            profile, opts, workload="fixed", output_len=2, num_requests=opts.alone_requests,
            arrival="fixed", rate=spaced, json_path=work / "calibrate-alone.json",
        )  # fmt: skip
        with served(plan_path, work / "calibrate-serve.log", opts.ports) as url:
            alone = _observe(replace(alone_opts, url=url))
            loaded = _observe(replace(loaded_opts, url=url, rate=rate))
    request_s = fit_request_s(profile, placement, alone)
    profile = replace(profile, serving=replace(profile.serving, request_s=request_s))
    contention, error = fit_contention(profile, placement, loaded, opts.seed)
    log.info(
        "calibrated at %.2f req/s: request %.1f ms, contention prefill %.2f decode %.2f "
        "(fit error %.2f)", rate, request_s * 1e3, contention.prefill, contention.decode, error
    )  # fmt: skip
    calibrated = replace(profile, contention=contention)
    hardware = dict(calibrated.hardware)
    hardware["calibration"] = {
        "placement": placement.to_dict(),
        "workload": opts.workload,
        "input_len": opts.input_len,
        "output_len": opts.output_len,
        "rate": rate,
        "num_requests": opts.num_requests,
        "fit_error": error,
    }
    return replace(calibrated, hardware=hardware)
