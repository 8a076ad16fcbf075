"""What ``splitserve bench`` runs: build the requests once, then probe each target in turn."""

from __future__ import annotations

import asyncio
import dataclasses
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitserve_tools.bench.goodput import Probe, probe, search_goodput, slo_scale_sweep
from splitserve_tools.bench.prompts import load_bench_tokenizer, prompt_maker
from splitserve_tools.bench.report import TargetResult, build_report, write_json, write_plots
from splitserve_tools.bench.requests import Request, make_requests, make_session_requests
from splitserve_tools.bench.runner import Schedule
from splitserve_tools.bench.target import make_target
from splitserve_tools.workload.lengths import workload_lengths
from splitserve_tools.workload.search import SearchSettings
from splitserve_tools.workload.sessions import (
    SESSION_WORKLOADS,
    first_turn_arrivals,
    probe_turns,
    session_turns,
)
from splitserve_tools.workload.slo import SLO


@dataclass(frozen=True)
class BenchOptions:
    targets: list[str]
    url: str = "localhost:8001"
    workload: str = "chatbot"
    input_len: int | None = None
    output_len: int | None = None
    tokenizer: str = "tiny"
    max_model_len: int = 2048
    arrival: str = "poisson"
    cv: float = 1.0
    rate: float | None = None
    goodput: bool = False
    rate_min: float = 0.1
    rate_max: float = 10.0
    max_probes: int = 8
    num_requests: int = 100
    ttft_slo: float = 1.0
    tpot_slo: float = 0.1
    attainment: float = 0.9
    slo_scales: list[float] = field(default_factory=list)
    json_path: Path | None = None
    plot_dir: Path | None = None
    seed: int = 0
    progress: bool = True


def build_lengths(opts: BenchOptions) -> list[tuple[int, int]]:
    """(input, output) tokens of each request, in arrival order."""
    return workload_lengths(
        opts.workload,
        opts.num_requests,
        opts.max_model_len,
        opts.seed,
        input_len=opts.input_len,
        output_len=opts.output_len,
    )


def rate_seed(seed: int, rate: float) -> int:
    """The prompt seed of a probe at ``rate``: each probed rate sends texts of its own (same
    lengths), so that no server, ours or a peer's, replays prompts it cached in an earlier
    probe."""
    return zlib.crc32(f"{seed}:{rate!r}".encode())


def build_requests(opts: BenchOptions, rate: float | None = None) -> list[Request]:
    """The requests of a probe at ``rate`` (None: of the bench's ``seed`` alone). A session
    workload's probe sends at least a minute of turns at its rate (``probe_turns``)."""
    tokenizer = load_bench_tokenizer(opts.tokenizer)
    seed = opts.seed if rate is None else rate_seed(opts.seed, rate)
    if opts.workload in SESSION_WORKLOADS:
        count = opts.num_requests if rate is None else probe_turns(opts.num_requests, rate)
        turns = session_turns(opts.workload, count, opts.max_model_len, opts.seed)
        return make_session_requests(turns, prompt_maker(tokenizer), seed)
    return make_requests(build_lengths(opts), prompt_maker(tokenizer), seed)


def schedule(opts: BenchOptions, requests: list[Request], rate: float) -> Schedule:
    """Arrival offsets at ``rate`` requests/s: sessions arrive as the arrival process says (at
    the rate that sends ``rate`` requests/s in all); a later turn is listed at its session's
    arrival and sent once the turn before it ended."""
    follows = [r.follows for r in requests]
    at = first_turn_arrivals(follows, rate, opts.arrival, opts.seed, opts.cv)
    offsets: list[float] = []
    for i, r in enumerate(requests):
        offsets.append(at[i] if r.follows is None else offsets[r.follows])
    return list(zip(offsets, requests, strict=True))


async def _bench_target(spec: str, opts: BenchOptions, slo: SLO) -> TargetResult:
    def schedule_for(rate: float) -> Schedule:
        return schedule(opts, build_requests(opts, rate), rate)

    target = make_target(spec, opts.url)
    try:
        goodput: float | None = None
        probes: list[Probe]
        if opts.goodput:
            settings = SearchSettings(opts.rate_min, opts.rate_max, max_probes=opts.max_probes)
            found = await search_goodput(target, schedule_for, slo, settings, opts.progress)
            goodput, probes = found.goodput_rps, found.probes
        else:
            assert opts.rate is not None
            probes = [await probe(target, schedule_for, opts.rate, slo, opts.progress)]
    finally:
        await target.close()
    result = TargetResult(spec, probes, goodput)
    if opts.slo_scales:
        sweep = slo_scale_sweep(result.main.records, slo, opts.slo_scales)
        result = dataclasses.replace(result, slo_scales=sweep)
    return result


async def run_bench(opts: BenchOptions) -> dict[str, Any]:
    """Benchmark every target (one after the other, same requests); returns the JSON report and
    writes it / the plots where asked."""
    if not opts.goodput and opts.rate is None:
        raise ValueError("give --rate, or --goodput to search for it")
    slo = SLO(opts.ttft_slo, opts.tpot_slo, opts.attainment)
    results = [await _bench_target(spec, opts, slo) for spec in opts.targets]
    config = {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(opts).items()}
    report = build_report(results, workload=opts.workload, slo=slo, config=config)
    if opts.json_path is not None:
        write_json(report, opts.json_path)
    if opts.plot_dir is not None:
        write_plots(results, slo, opts.plot_dir)
    return report


def bench(opts: BenchOptions) -> dict[str, Any]:
    return asyncio.run(run_bench(opts))


def summary_lines(report: dict[str, Any]) -> list[str]:
    """A plain table of the report's summary: one line per target."""
    lines = [
        f"{'target':<40} {'rate':>7} {'sent/s':>6} {'attain':>6} {'goodput':>8} "
        f"{'TTFT p50/p99 ms':>17} "
        f"{'TPOT p50/p99 ms':>17} {'errors':>6}"
    ]
    for s in report["summary"]:
        goodput = "-" if s["goodput_rps"] is None else f"{s['goodput_rps']:.3g}"
        lines.append(
            f"{s['target']:<40} {s['rate']:>7.3g} {s['requests_per_s']:>6.3g} "
            f"{s['attainment']:>6.2f} {goodput:>8} "
            f"{_ms(s['ttft_p50'])}/{_ms(s['ttft_p99'])} {_ms(s['tpot_p50'])}/{_ms(s['tpot_p99'])} "
            f"{s['errors']:>6}"
        )
    return lines


def _ms(seconds: float | None) -> str:
    return f"{'nan' if seconds is None else f'{seconds * 1e3:.1f}':>8}"
