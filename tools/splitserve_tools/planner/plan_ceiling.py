"""``splitserve plan ceiling``: how far a measured goodput is from what the engine, and the
hardware under it, could sustain at all."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _measured(text: str) -> tuple[str, float]:
    label, sep, value = text.rpartition("=")
    try:
        if not sep or not label:
            raise ValueError
        return label, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LABEL=REQ_PER_S, got {text!r}") from None


def plot_ceilings(path: Path, doc: dict[str, Any], title: str) -> None:
    """Bars: each ceiling of each source; lines: the measured goodputs across them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = doc["ceilings"]
    first = next(iter(sources.values()))
    devices = first["devices"]
    rows: list[tuple[str, str, str | None]] = [("any placement", "shared_rps", None)]
    rows += [(f"colocated, {k} per\ninstance", "colocated_rps", k) for k in first["colocated_rps"]]
    rows += [
        (f"disaggregated\n{p} + {devices - int(p)}", "split_rps", p) for p in first["split_rps"]
    ]

    def value(c: dict[str, Any], key: str, sub: str | None) -> float:
        v = c[key] if sub is None else c[key].get(sub)
        return float(v) if v is not None else 0.0

    fig, ax = plt.subplots(figsize=(7.5, 5))
    width = 0.8 / len(sources)
    for i, (name, c) in enumerate(sources.items()):
        xs = [j + (i - (len(sources) - 1) / 2) * width for j in range(len(rows))]
        ax.bar(xs, [value(c, key, sub) for _, key, sub in rows], width, label=f"{name} ceiling")
    for k, (label, rps) in enumerate(doc["measured"].items()):
        ax.axhline(rps, color=f"C{k + len(sources)}", linestyle="--", label=f"measured {label}")
    ax.set_xticks(range(len(rows)), [label for label, _, _ in rows])
    ax.set_ylabel("goodput (req/s)")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


BENCH_SETTINGS = ("workload", "input_len", "output_len", "tpot_slo", "max_model_len")
DEFAULTS: dict[str, Any] = {"workload": "chatbot", "max_model_len": 2048}


def from_bench(path: Path) -> tuple[dict[str, Any], dict[str, float]]:
    """A ``splitserve bench --goodput --json`` report: its workload settings, and each target's
    goodput."""
    try:
        doc = json.loads(path.read_text())
        config = doc["config"]
        goodputs = {s["target"]: float(s["goodput_rps"]) for s in doc["summary"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--bench {path}: not a bench goodput report ({e})") from None
    return {k: config.get(k) for k in BENCH_SETTINGS}, goodputs


def resolve(args: argparse.Namespace) -> dict[str, float]:
    """Fills the workload settings left out from the first ``--bench`` report (or defaults),
    and returns every measured goodput to show."""
    measured: dict[str, float] = {}
    settings: dict[str, Any] = {}
    for path in args.bench or []:
        found, goodputs = from_bench(path)
        settings = settings or found
        measured.update(goodputs)
    measured.update(dict(args.measured or []))
    for key in BENCH_SETTINGS:
        if getattr(args, key) is None:
            setattr(args, key, settings.get(key) or DEFAULTS.get(key))
    if args.tpot_slo is None:
        raise SystemExit("plan ceiling: give --tpot-slo (or a --bench report that has one)")
    return measured


def cmd_plan_ceiling(args: argparse.Namespace) -> None:
    from splitserve.model import is_tiny
    from splitserve.model.hf_config import ModelConfig
    from splitserve.model.tiny import tiny_config
    from splitserve_tools.planner.ceiling import Lengths, ceilings
    from splitserve_tools.planner.ceiling_report import (
        ceiling_dict,
        ceiling_lines,
        extrapolation_lines,
    )
    from splitserve_tools.planner.profile import Profile
    from splitserve_tools.planner.roofline import engine_costs, roofline_costs
    from splitserve_tools.workload.lengths import workload_lengths

    measured = resolve(args)
    profile = Profile.load(args.profile)
    model = args.model or profile.model
    cfg = tiny_config() if is_tiny(model) else ModelConfig.from_dir(model)
    max_len = min(args.max_model_len, profile.shape.max_model_len)
    pairs = workload_lengths(
        args.workload,
        args.num_requests,
        max_len,
        args.seed,
        input_len=args.input_len,
        output_len=args.output_len,
    )
    lengths = Lengths.of(pairs)
    devices = args.cores or args.gpus
    sources = {"engine": ceilings(engine_costs(profile), lengths, args.tpot_slo, devices)}
    roofline = roofline_costs(cfg, profile, devices)
    if roofline:
        sources["roofline"] = ceilings(roofline, lengths, args.tpot_slo, devices)
    lines = ceiling_lines(profile, lengths, args.tpot_slo, sources, measured)
    print("\n".join(lines + extrapolation_lines(profile, sources["engine"])))
    doc = ceiling_dict(lengths, args.tpot_slo, sources, measured)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        slo = f"TPOT <= {args.tpot_slo * 1e3:.0f} ms"
        title = f"{args.workload}, {slo}, {devices} {profile.unit_name}: steady-state ceilings"
        plot_ceilings(args.plot, doc, title)
        print(f"wrote {args.plot}")


def add_ceiling_parser(psub: argparse._SubParsersAction) -> None:
    c = psub.add_parser(
        "ceiling",
        help="steady-state goodput ceilings of the profiled engine and of the hardware's roofline",
    )
    c.add_argument("--profile", type=Path, required=True)
    c.add_argument("--model", help="checkpoint for the roofline's shapes (default: the profile's)")
    c.add_argument(
        "--bench",
        type=Path,
        action="append",
        help="a `splitserve bench --goodput --json` report: each target's goodput is shown as a "
        "fraction of the ceilings, and its workload, lengths and TPOT target are the defaults "
        "(repeatable)",
    )
    c.add_argument(
        "--workload",
        choices=["chatbot", "code", "summarization", "fixed"],
        help="default: the --bench report's, else chatbot",
    )
    c.add_argument("--input-len", type=int)
    c.add_argument("--output-len", type=int)
    c.add_argument("--tpot-slo", type=float, help="seconds (default: the --bench report's)")
    budget = c.add_mutually_exclusive_group(required=True)
    budget.add_argument("--cores", type=int, help="cores of the machine")
    budget.add_argument("--gpus", type=int, help="GPUs of the machine")
    c.add_argument("--max-model-len", type=int, help="default: the --bench report's, else 2048")
    c.add_argument("--num-requests", type=int, default=2000, help="requests to take lengths from")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument(
        "--measured",
        type=_measured,
        action="append",
        metavar="LABEL=REQ_PER_S",
        help="a measured goodput to print as a fraction of the ceilings (repeatable)",
    )
    c.add_argument("--json", type=Path, help="write the ceilings here")
    c.add_argument("--plot", type=Path, help="a PNG of the ceilings and the measured goodputs")
    c.set_defaults(func=cmd_plan_ceiling)
