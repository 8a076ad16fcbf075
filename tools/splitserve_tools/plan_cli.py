"""``splitserve plan``: the planner's subcommands (profile, calibrate, search, ceiling) and their
flags."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from splitserve_tools.planner.plan_ceiling import add_ceiling_parser
from splitserve_tools.planner.plan_link import add_link_parser
from splitserve_tools.workload.sessions import SESSION_WORKLOADS


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def cmd_plan_profile(args: argparse.Namespace) -> None:
    import dataclasses

    from splitserve_tools.planner.commands import QUICK_POINTS, build_profile, profile_lines
    from splitserve_tools.planner.measure import Points
    from splitserve_tools.planner.profile import Profile, ServingOverhead, with_costs_of

    points = QUICK_POINTS if args.quick else Points()
    given = {
        key: getattr(args, key)
        for key in ("prefill_lengths", "prefill_batches", "decode_batches", "decode_contexts")
        if getattr(args, key) is not None
    }
    for key in ("decode_steps", "repeats"):
        if getattr(args, key) is not None:
            given[key] = getattr(args, key)
    points = dataclasses.replace(points, **given)
    profile = build_profile(
        args.model,
        args.device,
        args.dtype or ("bfloat16" if args.modelled else "float32"),
        points,
        cores=list(args.cores) if args.cores else None,
        modelled=args.modelled,
        serving=ServingOverhead(args.token_overhead_ms / 1e3, args.request_overhead_ms / 1e3),
        progress=not args.no_progress,
    )
    if args.costs_from is not None:
        profile = with_costs_of(profile, Profile.load(args.costs_from))
        print(f"serving costs and contention from {args.costs_from}")
    profile.save(args.out)
    print("\n".join(profile_lines(profile)))
    print(f"wrote {args.out}")
    if not args.quick:  # a smoke test: not what serve should plan from
        _cache(profile)


def _cache(profile: Any) -> None:
    """Keep a measured profile where ``splitserve serve`` plans from."""
    from splitserve_tools.planner import profile_cache

    try:
        path = profile_cache.store(profile, profile.model)
    except (OSError, ValueError) as exc:
        print(f"not cached for `splitserve serve`: {exc}")
        return
    if path is not None:
        print(f"cached for `splitserve serve` (it plans from this without placement flags): {path}")


def cmd_plan_calibrate(args: argparse.Namespace) -> None:
    from splitserve_tools.plan_calibrate import CalibrateOptions, calibrate
    from splitserve_tools.planner.commands import profile_lines
    from splitserve_tools.planner.profile import Profile
    from splitserve_tools.planner.served_plan import Ports

    profile = Profile.load(args.profile)
    opts = CalibrateOptions(
        devices=args.cores or args.gpus,
        workload=args.workload,
        input_len=args.input_len,
        output_len=args.output_len,
        num_requests=args.num_requests,
        max_model_len=args.max_model_len,
        kv_cache_bytes=args.kv_cache_bytes,
        ports=Ports(args.http_port, args.grpc_port, args.metrics_port),
        progress=not args.no_progress,
    )
    calibrated = calibrate(profile, opts, args.work_dir)
    calibrated.save(args.out)
    print("\n".join(profile_lines(calibrated)))
    print(f"wrote {args.out}")
    _cache(calibrated)


def cmd_plan_search(args: argparse.Namespace) -> None:
    from splitserve_tools.planner.commands import (
        default_limits,
        make_plan,
        result_lines,
        search_budget,
        write_results,
    )
    from splitserve_tools.planner.profile import Profile
    from splitserve_tools.planner.simulate import Traffic
    from splitserve_tools.workload.slo import SLO

    profile = Profile.load(args.profile)
    if args.link_json is not None:
        from dataclasses import replace

        from splitserve_tools.planner.fit import link_fit

        encoding = "fp8" if args.kv_transfer_dtype == "fp8" else "raw"
        handoff = link_fit(json.loads(args.link_json.read_text()), args.link_rate, encoding)
        profile = replace(profile, handoff=handoff)
        print(
            f"prefill and decode on different nodes: {encoding} handoff measured over the link "
            f"({args.link_json}): {handoff.fixed_s * 1e3:.2f} ms + "
            f"{handoff.bytes_per_s * 8 / 1e9:.2f} Gbit/s"
        )
    elif args.link_gbit is not None:
        from dataclasses import replace

        from splitserve_tools.planner.fit import over_link

        handoff = over_link(profile.handoff, args.link_gbit, args.link_latency_ms / 1e3)
        profile = replace(profile, handoff=handoff)
        print(
            f"prefill and decode on different nodes: handoff over a {args.link_gbit:g} Gbit/s "
            f"link, {args.link_latency_ms:g} ms latency"
        )
    if args.kv_stream_layers:
        from dataclasses import replace

        from splitserve.serving.serving_config import ServingConfig

        least = args.kv_stream_min_tokens
        if least is None:
            least = ServingConfig.kv_stream_min_tokens
        gap = args.kv_stream_min_gap_s
        if gap is None:
            gap = ServingConfig.kv_stream_min_gap_s
        handoff = replace(
            profile.handoff,
            stream_layers=args.kv_stream_layers,
            stream_min_tokens=least,
            stream_min_gap_s=gap,
        )
        profile = replace(profile, handoff=handoff)
        print(
            f"the KV streams by layer during the pass ({args.kv_stream_layers} layers, runs at "
            f"least {gap * 1e3:g} ms of pass apart; prompts under {least} tokens after it)"
        )
    budgets = args.cores or args.gpus
    if (args.cores is not None) != (profile.device == "cpu"):
        raise SystemExit(
            f"this profile is of device {profile.device!r}: give --cores for cpu, --gpus for gpu"
        )
    if len(budgets) > 1 and (args.out or args.render):
        raise SystemExit("--out and --render need a single --cores/--gpus budget")
    max_len = min(args.max_model_len, profile.shape.max_model_len)
    traffic = Traffic.of_workload(
        args.workload,
        args.num_requests,
        max_len,
        args.seed,
        args.arrival,
        args.cv,
        input_len=args.input_len,
        output_len=args.output_len,
        min_duration_s=args.min_duration_s,
    )
    slo = SLO(args.ttft_slo, args.tpot_slo, args.attainment)
    base = default_limits(profile, args.kv_cache_bytes)
    if args.no_prefix_cache:
        from dataclasses import replace

        base = replace(base, prefix_cache=False)
    results = []
    for devices in budgets:
        result = search_budget(profile, traffic, slo, devices, base, not args.no_progress)
        results.append(result)
        print("\n".join(result_lines(profile, result, args.top)))
    if args.json:
        write_results(args.json, profile, results)
    if args.out or args.render or args.k8s:
        info = {
            "workload": args.workload,
            "num_requests": args.num_requests,
            "max_model_len": max_len,
            "seed": args.seed,
            "arrival": args.arrival,
            "cv": args.cv,
            "min_duration_s": args.min_duration_s,
        }
        plan = make_plan(profile, results[0], info, slo, max_len, args.top)
        if args.out:
            plan.save(args.out)
            print(f"wrote {args.out}")
        if args.render:
            from splitserve.deploy.render import render

            render(plan.to_spec(), args.render)
            print(f"rendered the model repository into {args.render}")
        if args.k8s:
            write_k8s(plan.placement, profile.device == "gpu", args.k8s, args.k8s_base)


def write_k8s(placement: Any, gpu: bool, out_dir: Path, base: Path | None) -> None:
    """``--k8s``: a kustomize overlay with the replicas and per-pod cores of a disagg plan (one
    prefill or decode instance per pod)."""
    from splitserve_tools.k8s_overlay import overlay_dir, write_overlay

    if placement.mode != "disagg":
        raise SystemExit(
            "--k8s: the Kubernetes deployment splits prefill and decode across pods; this plan "
            "is colocated (serve it with `splitserve serve --plan`)"
        )
    base_dir = base or overlay_dir(Path.cwd(), gpu)
    path = write_overlay(
        out_dir,
        base=str(base_dir),
        prefill_replicas=placement.prefill.instances,
        decode_replicas=placement.decode.instances,
        prefill_cpu=None if gpu else str(placement.prefill.units),
        decode_cpu=None if gpu else str(placement.decode.units),
        gpu=gpu,
    )
    print(f"wrote the Kubernetes overlay {path} (kubectl apply -k {out_dir})")


def add_plan_parsers(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser("plan", help="offline placement planner: profile, simulate, search")
    psub = plan.add_subparsers(dest="plan_command", required=True)

    p = psub.add_parser("profile", help="time prefill and decode steps and fit a latency model")
    p.add_argument("--model", default="tiny", help="'tiny' or a local checkpoint dir")
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--cores",
        type=_ints,
        help="core counts per instance to profile, e.g. 1,2 (one pinned subprocess each); "
        "default: this process's cores",
    )
    p.add_argument(
        "--modelled",
        action="store_true",
        help="GPU: compute the profile from H200 bandwidth and FLOP rate instead of measuring",
    )
    p.add_argument("--quick", action="store_true", help="very few points (a smoke test)")
    p.add_argument("--prefill-lengths", type=_ints)
    p.add_argument("--prefill-batches", type=_ints)
    p.add_argument("--decode-batches", type=_ints)
    p.add_argument("--decode-contexts", type=_ints, help="context tokens per sequence")
    p.add_argument("--decode-steps", type=int)
    p.add_argument("--repeats", type=int)
    p.add_argument(
        "--token-overhead-ms",
        type=float,
        default=0.3,
        help="serving cost per streamed token (the Python backend's response IPC; 0.3 ms measured "
        "on the 2-core machine, BENCHMARKS.md)",
    )
    p.add_argument("--request-overhead-ms", type=float, default=0.0)
    p.add_argument(
        "--costs-from",
        type=Path,
        help="a calibrated profile (`plan calibrate`) of another model on this machine: take its "
        "serving costs and contention instead of --token/--request-overhead-ms",
    )
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_plan_profile)

    c = psub.add_parser(
        "calibrate",
        help="serve the default placement, time it with the bench, fit the serving costs",
    )
    c.add_argument("--profile", type=Path, required=True)
    c.add_argument("--out", type=Path, required=True, help="the calibrated profile")
    devices = c.add_mutually_exclusive_group(required=True)
    devices.add_argument("--cores", type=int, help="cores of the served placement")
    devices.add_argument("--gpus", type=int, help="GPUs of the served placement")
    c.add_argument(
        "--workload",
        choices=["chatbot", "code", "summarization", "fixed"],
        default="fixed",
        help="lengths of the loaded run: best the workload you plan for",
    )
    c.add_argument("--input-len", type=int, default=512)
    c.add_argument("--output-len", type=int, default=128)
    c.add_argument("--num-requests", type=int, default=150, help="requests of the loaded run")
    c.add_argument("--max-model-len", type=int, default=2048)
    c.add_argument("--kv-cache-bytes", type=int, help="KV pool per instance")
    c.add_argument("--http-port", type=int, default=18700)
    c.add_argument("--grpc-port", type=int, default=18701)
    c.add_argument("--metrics-port", type=int, default=18702)
    c.add_argument("--work-dir", type=Path, help="keep the bench reports and server log here")
    c.add_argument("--no-progress", action="store_true")
    c.set_defaults(func=cmd_plan_calibrate)

    s = psub.add_parser("search", help="simulate placements and rank them by goodput per device")
    s.add_argument("--profile", type=Path, required=True)
    s.add_argument(
        "--workload",
        choices=["chatbot", "code", "summarization", "fixed", *SESSION_WORKLOADS],
        default="chatbot",
        help="multi-turn / shared-prefix: prompts that share prefixes, served by the simulated "
        "prefix caches (--no-prefix-cache: as a server without them)",
    )
    s.add_argument("--no-prefix-cache", action="store_true")
    s.add_argument("--input-len", type=int)
    s.add_argument("--output-len", type=int)
    s.add_argument("--ttft-slo", type=float, required=True, help="seconds")
    s.add_argument("--tpot-slo", type=float, required=True, help="seconds")
    s.add_argument("--attainment", type=float, default=0.9)
    budget = s.add_mutually_exclusive_group(required=True)
    budget.add_argument("--cores", type=_ints, help="cores to place on (a list: one search each)")
    budget.add_argument("--gpus", type=_ints, help="GPUs to place on, e.g. 8 or 1,2,4,8")
    s.add_argument("--max-model-len", type=int, default=2048)
    s.add_argument("--num-requests", type=int, default=300, help="simulated requests per run")
    s.add_argument(
        "--min-duration-s",
        type=float,
        default=20.0,
        help="at high rates, repeat the requests until arrivals span this long (sustained "
        "load, not one burst); 0: exactly --num-requests, as `splitserve bench` sends",
    )
    s.add_argument("--arrival", choices=["poisson", "gamma", "fixed"], default="poisson")
    s.add_argument("--cv", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--kv-cache-bytes", type=int, help="KV pool per instance")
    s.add_argument(
        "--link-gbit",
        type=float,
        help="price the KV handoff across nodes over a link of this goodput (Gbit/s; "
        "`splitserve plan link` measures the real handoff: --link-json)",
    )
    s.add_argument(
        "--link-latency-ms", type=float, default=0.1, help="with --link-gbit (default 0.1)"
    )
    s.add_argument(
        "--link-json",
        type=Path,
        help="price the handoff across nodes by what `splitserve plan link measure --out` (or "
        "scripts/bench_link.py --json) measured: a fit of its handoff times at --link-rate",
    )
    s.add_argument(
        "--link-rate",
        type=float,
        help="with --link-json: the tc rate (Gbit/s) of the rows to fit (default: the unlimited "
        "link's rows)",
    )
    s.add_argument(
        "--kv-transfer-dtype",
        choices=["auto", "fp8"],
        default="auto",
        help="with --link-json: price the handoff by that file's rows of this encoding",
    )
    s.add_argument(
        "--kv-stream-layers",
        type=int,
        default=0,
        metavar="LAYERS",
        help="price a handoff streamed by layer during the pass (prefill servers' default), "
        "LAYERS the model's num_hidden_layers; 0: after the pass",
    )
    s.add_argument(
        "--kv-stream-min-tokens",
        type=int,
        help="with --kv-stream-layers: shorter prompts move after the pass (default: the "
        "prefill server's default kv_stream_min_tokens)",
    )
    s.add_argument(
        "--kv-stream-min-gap-s",
        type=float,
        help="with --kv-stream-layers: the least pass time between two runs of layers handed "
        "on (default: the prefill server's default kv_stream_min_gap_s)",
    )
    s.add_argument("--top", type=int, default=8, help="placements to print")
    s.add_argument("--out", type=Path, help="write the best placement as plan.json")
    s.add_argument("--render", type=Path, help="render its Triton model repository here")
    s.add_argument(
        "--k8s",
        type=Path,
        help="write a kustomize overlay of deploy/k8s with the plan's replicas and cores here",
    )
    s.add_argument(
        "--k8s-base",
        type=Path,
        help="the overlay it builds on (default: deploy/k8s/overlays/cpu or gpu of this directory)",
    )
    s.add_argument("--json", type=Path, help="every placement tried, with its attainment curve")
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(func=cmd_plan_search)

    add_ceiling_parser(psub)
    add_link_parser(psub)
