"""``splitserve serve`` without placement flags: serve the planner's choice for this model and
machine, from the profile that ``plan profile`` / ``plan calibrate`` cached for them, and say
which placement it took and why; without a cached profile, the default layout (and how to get
one). The runtime's ``serve`` knows nothing of the planner: this fills in its ``--plan``."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from splitserve_tools.planner.plan import Plan

log = logging.getLogger("splitserve.plan")

WORKLOADS = ("chatbot", "code", "summarization")
SIMULATED_REQUESTS = 300
MIN_DURATION_S = 20.0
"""Requests per simulated run, and how long arrivals span at least: ``plan search``'s defaults,
so that both choose the same."""


def add_choice_arguments(serve: argparse.ArgumentParser) -> None:
    g = serve.add_argument_group(
        "the planner's choice",
        "Without placement flags (--layout, --*-instances, --*-cores, --*-gpus, --plan), serve "
        "searches the profile that `splitserve plan profile` cached for this checkpoint, dtype "
        "and machine, and serves the best placement for these targets (docs/planner.md).",
    )
    g.add_argument("--no-plan", action="store_true", help="serve the default layout")
    g.add_argument("--workload", choices=WORKLOADS, default="chatbot", help="to plan for")
    g.add_argument("--ttft-slo", type=float, default=1.0, help="seconds (default 1)")
    g.add_argument("--tpot-slo", type=float, default=0.1, help="seconds (default 0.1)")


def explicit_placement(args: argparse.Namespace) -> list[str]:
    """The flags given that place instances themselves (``--device`` alone does not)."""
    from splitserve.cli import PLACEMENT_FLAGS

    given = [
        f"--{key.replace('_', '-')}"
        for key in PLACEMENT_FLAGS
        if key != "device" and getattr(args, key) is not None
    ]
    if args.plan is not None:
        given.append("--plan")
    if args.role != "both":
        given.append("--role")
    if args.prefill_url or args.prefill_dns:
        given.append("--prefill-url/--prefill-dns")
    return given


def _budget(device: str) -> tuple[int, tuple[int, ...] | None]:
    """Devices to place on: the cores this process may run on (with the cores themselves), or
    the GPUs it sees."""
    if device == "gpu":
        import torch

        return torch.cuda.device_count(), None
    cores = tuple(sorted(os.sched_getaffinity(0)))
    return len(cores), cores


def choose(args: argparse.Namespace) -> None:
    """Set ``args.plan`` to the planner's choice where ``serve`` was given no placement; log
    what it took, or why it serves the default layout."""
    if args.no_plan or explicit_placement(args):
        return
    from splitserve.cli import serve_options
    from splitserve.engine_config import EngineConfig
    from splitserve_tools.planner import profile_cache

    try:
        settings = serve_options(args).settings
    except ValueError:
        return  # `serve` itself names the bad flag
    model = args.model or "tiny"
    dtype = settings.get("dtype", EngineConfig.dtype)
    device = args.device or "cpu"
    try:
        found, where = profile_cache.lookup(model, dtype, device)
    except ValueError as exc:
        log.info("serving the default layout: %s", exc)
        return
    if found is None:
        if where is not None:
            log.info(
                "serving the default layout: no profile of %s (%s) on this machine in %s; "
                "`splitserve plan profile --model %s --dtype %s` caches one (then "
                "`splitserve plan calibrate` its serving costs), and serve plans from it",
                model,
                dtype,
                where.parent,
                model,
                dtype,
            )
        return
    try:
        plan_file, lines = _plan(args, found, settings, device)
    except (OSError, ValueError, KeyError) as exc:
        log.warning("serving the default layout: the planner could not plan (%s)", exc)
        return
    for line in lines:
        log.info("%s", line)
    args.plan = plan_file
    args.device = None  # the plan names it (the profile was looked up for this device)


def _plan(
    args: argparse.Namespace, profile_file: Path, settings: dict[str, str], device: str
) -> tuple[Path, list[str]]:
    from splitserve_tools.planner.commands import default_limits, make_plan, search_budget
    from splitserve_tools.planner.profile import Profile
    from splitserve_tools.planner.profile_cache import plan_path
    from splitserve_tools.planner.simulate import Traffic
    from splitserve_tools.workload.slo import SLO

    profile = Profile.load(profile_file)
    devices, cores = _budget(device)
    max_len = profile.shape.max_model_len
    if "max_model_len" in settings:
        max_len = min(int(settings["max_model_len"]), max_len)
    kv_bytes = int(settings["kv_cache_bytes"]) if "kv_cache_bytes" in settings else None
    slo = SLO(args.ttft_slo, args.tpot_slo)
    searched: dict[str, Any] = {
        "workload": args.workload,
        "ttft_s": slo.ttft_s,
        "tpot_s": slo.tpot_s,
        "attainment": slo.attainment,
        "devices": devices,
        "cores": cores,
        "max_model_len": max_len,
        "kv_cache_bytes": kv_bytes,
        "num_requests": SIMULATED_REQUESTS,
        "min_duration_s": MIN_DURATION_S,
    }
    path = plan_path(profile_file, searched)
    unit = profile.unit_name
    plan = _kept(path)
    if plan is not None:
        how = f"searched before ({path})"
    else:
        traffic = Traffic.of_workload(
            args.workload, SIMULATED_REQUESTS, max_len, 0, min_duration_s=MIN_DURATION_S
        )
        log.info(
            "planning %s on %d %s for %s (TTFT <= %g s, TPOT <= %g s) from %s",
            profile.model,
            devices,
            unit,
            args.workload,
            slo.ttft_s,
            slo.tpot_s,
            profile_file,
        )
        base = default_limits(profile, kv_bytes)
        result = search_budget(profile, traffic, slo, devices, base, progress=True)
        info = {
            "workload": args.workload,
            "num_requests": SIMULATED_REQUESTS,
            "max_model_len": max_len,
        }
        plan = replace(make_plan(profile, result, info, slo, max_len, top=8), cores=cores)
        plan.save(path)
        how = f"saved as {path}"
    default = plan.context.get("default")
    beside = (
        f"; the default 1 + 1 split: {default['goodput_rps']:.2f} req/s"
        if isinstance(default, dict)
        else ""
    )
    lines = [
        f"serving the planner's choice for {args.workload} (TTFT <= {slo.ttft_s:g} s, "
        f"TPOT <= {slo.tpot_s:g} s, {slo.attainment:.0%} of requests) on {devices} {unit}: "
        f"{plan.placement.describe(unit)}, predicted {plan.predicted_goodput_rps:.2f} "
        f"req/s{beside}",
        f"  profile {profile_file} ({profile.hardware.get('cpu') or profile.hardware.get('gpu')}); "
        f"plan {how}; --no-plan serves the default layout",
    ]
    return path, lines


def _kept(path: Path) -> Plan | None:
    """The plan an earlier start searched, or None (none kept, or unreadable: search again)."""
    from splitserve_tools.planner.plan import Plan

    try:
        return Plan.load(path)
    except (OSError, ValueError, KeyError):
        return None
