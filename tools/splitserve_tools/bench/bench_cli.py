"""``splitserve bench``: its flags and what it runs."""

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_bench(args: argparse.Namespace) -> None:
    from splitserve_tools.bench.main import BenchOptions, bench, summary_lines

    report = bench(
        BenchOptions(
            targets=args.target or ["llm"],
            url=args.url,
            workload=args.workload,
            input_len=args.input_len,
            output_len=args.output_len,
            tokenizer=args.tokenizer,
            max_model_len=args.max_model_len,
            arrival=args.arrival,
            cv=args.cv,
            rate=args.rate,
            goodput=args.goodput,
            rate_min=args.rate_min,
            rate_max=args.rate_max,
            max_probes=args.max_probes,
            num_requests=args.num_requests,
            ttft_slo=args.ttft_slo,
            tpot_slo=args.tpot_slo,
            attainment=args.attainment,
            slo_scales=[float(s) for s in args.slo_scale.split(",")] if args.slo_scale else [],
            json_path=args.json,
            plot_dir=args.plot_dir,
            seed=args.seed,
            progress=not args.no_progress,
        )
    )
    print("\n".join(summary_lines(report)))


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="open-loop SLO attainment and goodput of one or more targets")
    b.add_argument("--url", default="localhost:8001", help="Triton gRPC address")
    b.add_argument(
        "--target",
        action="append",
        help="Triton model at --url (llm, llm_colocated) or openai:http://HOST:PORT/v1@MODEL; "
        "repeat to compare (default llm)",
    )
    b.add_argument(
        "--workload",
        choices=["chatbot", "code", "summarization", "fixed", "multi-turn", "shared-prefix"],
        default="chatbot",
        help="multi-turn: conversations whose every turn repeats the last (a shared system "
        "prompt, 2-6 turns); shared-prefix: single prompts behind one system prompt "
        "(splitserve_tools.workload.sessions); --rate counts their requests",
    )
    b.add_argument("--input-len", type=int, help="prompt tokens (fixed workload)")
    b.add_argument("--output-len", type=int, help="output tokens (fixed workload)")
    b.add_argument("--tokenizer", default="tiny", help="checkpoint dir, or 'tiny' (bytes)")
    b.add_argument(
        "--max-model-len",
        type=int,
        default=2048,
        help="the served context length: input + output never exceed it",
    )
    b.add_argument("--arrival", choices=["poisson", "gamma", "fixed"], default="poisson")
    b.add_argument("--cv", type=float, default=1.0, help="gamma arrivals: coefficient of variation")
    b.add_argument("--rate", type=float, help="requests per second (one run per target)")
    b.add_argument(
        "--goodput",
        action="store_true",
        help="the highest rate meeting --attainment: doubles from --rate-min until a run misses "
        "(at most --rate-max), then bisects",
    )
    b.add_argument("--rate-min", type=float, default=0.1)
    b.add_argument("--rate-max", type=float, default=10.0)
    b.add_argument("--max-probes", type=int, default=8, help="runs per target in the search")
    b.add_argument("--num-requests", type=int, default=100, help="requests per run")
    b.add_argument("--ttft-slo", type=float, default=1.0, help="seconds")
    b.add_argument("--tpot-slo", type=float, default=0.1, help="seconds")
    b.add_argument("--attainment", type=float, default=0.9)
    b.add_argument("--slo-scale", help="comma-separated SLO scales to sweep, e.g. 0.5,1,2,3")
    b.add_argument("--json", type=Path, help="write the report here")
    b.add_argument("--plot-dir", type=Path, help="write PNG plots here")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--no-progress", action="store_true")
    b.set_defaults(func=cmd_bench)
