"""The planner against reality: predicted vs measured goodput and attainment curves.

For each workload: profile the checkpoint (once), calibrate the profile on the real server
with that workload's lengths (`splitserve plan calibrate`: the default layout at one rate, other
requests than those measured here), let the planner pick a placement for the cores, serve that
placement and the hand-picked default layout in turn (`splitserve serve --plan`), measure each
with `splitserve bench --goodput`, and simulate the very same requests (same lengths, same
arrival times, same seed) at every rate the bench probed. Writes OUT/validate.json,
OUT/<workload>.png (predicted lines, measured points) and prints the errors. Needs a quiet
machine: anything else running skews both the profile and the measurement.

  python scripts/plan_validate.py --model 100m --workload chatbot --workload summarization \
      --ttft-slo 3 --tpot-slo 0.1 --cores 2 --num-requests 150 --rate-min 1 --out out/plan_validate
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from bench_common import checkpoint

from splitserve_tools.plan_calibrate import CalibrateOptions, calibrate
from splitserve_tools.planner.commands import (
    QUICK_POINTS,
    build_profile,
    default_limits,
    profile_lines,
)
from splitserve_tools.planner.measure import Points
from splitserve_tools.planner.plan import Plan
from splitserve_tools.planner.profile import Profile, ServingOverhead
from splitserve_tools.planner.search import default_placement, goodput, search
from splitserve_tools.planner.served_plan import served
from splitserve_tools.planner.simulate import Traffic, run
from splitserve_tools.workload.slo import SLO

ROOT = Path(__file__).resolve().parents[1]
CLI = (sys.executable, "-m", "splitserve_tools.cli")
TOKEN_OVERHEAD_MS = 0.3


def measure(plan_path: Path, args: argparse.Namespace, workload: str, out: Path) -> dict[str, Any]:
    """Serve the plan, run `splitserve bench --goodput` against it, return the bench report."""
    plan = Plan.load(plan_path)
    target = "llm_colocated" if plan.placement.mode == "colocated" else "llm"
    report = out / f"{plan_path.stem}-bench.json"
    with served(plan_path, out / f"{plan_path.stem}-serve.log") as url:
        bench = [
            *CLI,
            "bench",
            "--url",
            url,
            "--target",
            target,
            *("--workload", workload, "--tokenizer", plan.model),
            *("--max-model-len", str(plan.max_model_len), "--goodput"),
            *("--rate-min", str(args.rate_min), "--rate-max", str(args.rate_max)),
            *("--max-probes", str(args.max_probes), "--num-requests", str(args.num_requests)),
            *("--ttft-slo", str(args.ttft_slo), "--tpot-slo", str(args.tpot_slo)),
            *("--attainment", str(args.attainment), "--seed", str(args.seed)),
            *("--json", str(report)),
        ]
        if args.no_progress:
            bench.append("--no-progress")
        subprocess.run(bench, check=True)
    return json.loads(report.read_text())


def crossing(probes: list[tuple[float, float]], attainment: float) -> float:
    """Where attainment falls through ``attainment`` between the measured probes: log-linear
    between the highest passing rate and the next (failing) one above it; that rate itself
    when nothing above it was probed, 0 when nothing passed."""
    passing = [r for r, a in probes if a >= attainment]
    if not passing:
        return 0.0
    lo = max(passing)
    above = [(r, a) for r, a in probes if r > lo]
    if not above:
        return lo
    hi, a_hi = min(above)
    a_lo = dict(probes)[lo]
    frac = (a_lo - attainment) / (a_lo - a_hi)
    return float(np.exp(np.log(lo) + frac * (np.log(hi) - np.log(lo))))


def predicted_curve(
    profile: Profile, plan: Plan, traffic: Traffic, slo: SLO, rates: list[float]
) -> list[float]:
    return [
        run(profile, plan.placement, traffic, r).attainment(slo.ttft_s, slo.tpot_s) for r in rates
    ]


def plot(path: Path, workload: str, rows: list[dict[str, Any]], slo: SLO) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row, color in zip(rows, ("tab:blue", "tab:orange"), strict=False):
        grid = row["predicted_curve"]
        ax.plot(
            [g[0] for g in grid],
            [g[1] for g in grid],
            color=color,
            label=f"{row['name']} predicted",
        )
        probes = row["measured_probes"]
        ax.scatter([p[0] for p in probes], [p[1] for p in probes], color=color, marker="o",
                   label=f"{row['name']} measured")  # fmt: skip
        ax.axvline(row["predicted_goodput"], color=color, linestyle=":", linewidth=1)
        ax.axvline(row["measured_goodput"], color=color, linestyle="--", linewidth=1)
    ax.axhline(slo.attainment, color="grey", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment")
    ax.set_title(f"{workload}: TTFT <= {slo.ttft_s} s, TPOT <= {slo.tpot_s} s "
                 "(dotted: predicted goodput, dashed: measured)", fontsize=9)  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def calibrated(profile: Profile, args: argparse.Namespace, workload: str, out: Path) -> Profile:
    """The profile calibrated on this workload's lengths (or as given: --replay, --no-calibrate,
    or a --profile that was calibrated already)."""
    path = out / "profile-calibrated.json"
    if args.replay:
        earlier = args.replay / workload / path.name
        return Profile.load(earlier) if earlier.is_file() else profile
    if args.no_calibrate:
        return profile
    opts = CalibrateOptions(
        devices=args.cores,
        workload=workload,
        max_model_len=args.max_model_len,
        kv_cache_bytes=args.kv_cache_bytes,
        progress=not args.no_progress,
    )
    result = calibrate(profile, opts, out)
    result.save(path)
    print("\n".join(profile_lines(result)))
    return result


def validate_workload(
    profile: Profile, args: argparse.Namespace, workload: str, slo: SLO
) -> list[dict[str, Any]]:
    out = args.out / workload
    out.mkdir(parents=True, exist_ok=True)
    profile = calibrated(profile, args, workload, out)
    max_len = min(args.max_model_len, profile.shape.max_model_len)
    traffic = Traffic.of_workload(workload, args.num_requests, max_len, args.seed)
    if args.replay:
        picks = {
            name: Plan.load(args.replay / workload / f"{name}.json").placement
            for name in ("planner", "default")
        }
    else:
        base = default_limits(profile, args.kv_cache_bytes)
        ranked = search(profile, traffic, slo, args.cores, base, progress=not args.no_progress)
        picks = {
            "planner": ranked[0].placement,
            "default": default_placement(profile, args.cores, base),
        }
    rows = []
    for name, placement in picks.items():
        plan = Plan(profile.model, profile.dtype, "cpu", max_len, placement, 0.0)
        predicted = goodput(profile, placement, traffic, slo, max_rate=args.rate_max).goodput_rps
        plan = replace(plan, predicted_goodput_rps=predicted)
        plan.save(out / f"{name}.json")
        if args.replay:
            report = json.loads((args.replay / workload / f"{name}-bench.json").read_text())
        else:
            report = measure(out / f"{name}.json", args, workload, out)
        probes = sorted((r["rate"], r["attainment"]) for r in report["runs"])
        measured = float(report["summary"][0]["goodput_rps"] or 0.0)
        interpolated = crossing(probes, slo.attainment)
        rates = sorted({*np.geomspace(args.rate_min, args.rate_max, 24).tolist(),
                        *(p[0] for p in probes)})  # fmt: skip
        curve = predicted_curve(profile, plan, traffic, slo, rates)
        at_probes = predicted_curve(profile, plan, traffic, slo, [p[0] for p in probes])
        rows.append(
            {
                "name": name,
                "placement": placement.describe("cores"),
                "plan": plan.to_dict(),
                "predicted_goodput": predicted,
                "measured_goodput": measured,
                "goodput_error": (predicted - measured) / measured if measured else None,
                "measured_crossing": interpolated,
                "crossing_error": (
                    (predicted - interpolated) / interpolated if interpolated else None
                ),
                "measured_probes": probes,
                "predicted_at_probes": at_probes,
                "attainment_mae": float(
                    np.mean([abs(a - p[1]) for a, p in zip(at_probes, probes, strict=True)])
                ),
                "predicted_curve": list(zip(rates, curve, strict=True)),
            }
        )
    plot(args.out / f"{workload}.png", workload, rows, slo)
    return rows


def summary_lines(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    head = ("workload", "layout", "predicted", "measured", "error", "crossing", "error",
            "att. MAE", "placement")  # fmt: skip
    lines = ["", "{:<14}{:<9}{:>10}{:>10}{:>8}{:>10}{:>8}{:>10}  {}".format(*head)]
    worst = 0.0

    def pct(err: float | None) -> str:
        return f"{'n/a' if err is None else f'{err:+.0%}':>8}"

    for workload, rows in results.items():
        for r in rows:
            err = r["goodput_error"]
            worst = max(worst, abs(err) if err is not None else float("inf"))
            cells = (workload, r["name"], r["predicted_goodput"], r["measured_goodput"])
            lines.append(
                "{:<14}{:<9}{:>10.3f}{:>10.3f}".format(*cells)
                + pct(err)
                + f"{r['measured_crossing']:>10.3f}"
                + pct(r["crossing_error"])
                + f"{r['attainment_mae']:>10.3f}  {r['placement']}"
            )
        planner, default = rows[0]["measured_goodput"], rows[1]["measured_goodput"]
        gain = f"{planner / default:.2f}x" if default else "n/a (default layout: 0)"
        lines.append(f"{workload}: measured goodput, planner's pick / default layout = {gain}")
    lines.append(f"largest goodput error {worst:.0%} (target: within 15%)")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="100m", help="'tiny', a preset (100m) or a checkpoint dir")
    ap.add_argument(
        "--workload", action="append", help="repeatable (default chatbot, summarization)"
    )
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--ttft-slo", type=float, default=3.0)
    ap.add_argument("--tpot-slo", type=float, default=0.1)
    ap.add_argument("--attainment", type=float, default=0.9)
    ap.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument(
        "--profile-cores", default=None, help="core counts to profile (default 1..cores)"
    )
    ap.add_argument("--profile", type=Path, help="reuse this profile instead of measuring one")
    ap.add_argument("--quick-profile", action="store_true", help="very few points (smoke runs)")
    ap.add_argument(
        "--token-overhead-ms",
        type=float,
        help=f"per streamed token (default {TOKEN_OVERHEAD_MS}; replaces a --profile's own)",
    )
    ap.add_argument(
        "--no-calibrate",
        action="store_true",
        help="plan with the engine profile alone (no serving costs fitted on the real server)",
    )
    ap.add_argument(
        "--replay",
        type=Path,
        help="an earlier --out: its placements and measurements, predicted again (no serving)",
    )
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-bytes", type=int, default=2 << 30)
    ap.add_argument("--num-requests", type=int, default=40)
    ap.add_argument("--rate-min", type=float, default=0.1)
    ap.add_argument("--rate-max", type=float, default=8.0)
    ap.add_argument("--max-probes", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "plan_validate")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = (
        args.model if args.model == "tiny" or Path(args.model).is_dir() else checkpoint(args.model)
    )
    token_ms = TOKEN_OVERHEAD_MS if args.token_overhead_ms is None else args.token_overhead_ms
    overhead = ServingOverhead(token_s=token_ms / 1e3)
    if args.profile:
        profile = Profile.load(args.profile)
        if args.token_overhead_ms is not None:
            profile = replace(profile, serving=replace(profile.serving, token_s=overhead.token_s))
    else:
        counts = (
            [int(c) for c in args.profile_cores.split(",")]
            if args.profile_cores
            else list(range(1, args.cores + 1))
        )
        points = QUICK_POINTS if args.quick_profile else Points()
        profile = build_profile(
            model, "cpu", args.dtype, points, cores=counts,
            serving=overhead,
            progress=not args.no_progress,
        )  # fmt: skip
        profile.save(args.out / "profile.json")
    print("\n".join(profile_lines(profile)))
    slo = SLO(args.ttft_slo, args.tpot_slo, args.attainment)
    results = {
        w: validate_workload(profile, args, w, slo)
        for w in args.workload or ["chatbot", "summarization"]
    }
    (args.out / "validate.json").write_text(json.dumps(results, indent=1) + "\n")
    print("\n".join(summary_lines(results)))


if __name__ == "__main__":
    main()
