"""The JSON report's keys, the PNG plots, target specs and the ``bench`` command line."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from splitserve_client.stream import RequestRecord
from splitserve_tools.bench import target as target_module
from splitserve_tools.bench.goodput import Probe
from splitserve_tools.bench.metrics import summarize
from splitserve_tools.bench.report import TargetResult, build_report, write_json, write_plots
from splitserve_tools.bench.requests import Request
from splitserve_tools.cli import parser
from splitserve_tools.workload.slo import SLO

SLO_ = SLO(0.2, 0.02)
REQUESTS = [Request("x" * i, i + 1, 5) for i in range(1, 11)]
RUN_KEYS = {
    "target", "workload", "rate", "attainment", "errors", "num_requests", "duration_s",
    "ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p90", "tpot_p99",
    "e2e_p50", "e2e_p90", "e2e_p99", "meets_attainment", "requests",
}  # fmt: skip


def probe(rate: float, slowdown: float) -> Probe:
    records = []
    for i in range(10):
        ttft, tpot = 0.03 * i * slowdown, 0.004 * i * slowdown
        times = [ttft + k * tpot for k in range(5)]
        records.append(RequestRecord(start=0.0, token_times=times, end=times[-1], output_tokens=5))
    records[-1] = RequestRecord(start=0.0, end=1.0, error="refused")
    return Probe(rate, summarize(records, SLO_, 2.0), records, 2.0, REQUESTS)


def results() -> list[TargetResult]:
    return [
        TargetResult("llm", [probe(4.0, 2.0), probe(1.0, 0.5), probe(2.0, 1.0)], 2.0,
                     {0.5: 0.3, 1.0: 0.7, 2.0: 0.9}),
        TargetResult("llm_colocated", [probe(1.0, 1.0)]),
    ]  # fmt: skip


def test_report_json(tmp_path: Path) -> None:
    report = build_report(
        results(), workload="chatbot", slo=SLO_, config={"seed": 0},
    )  # fmt: skip
    path = tmp_path / "out" / "bench.json"
    write_json(report, path)
    data = json.loads(path.read_text())
    assert data["slo"] == {"ttft_s": 0.2, "tpot_s": 0.02, "attainment": 0.9}
    assert [(r["target"], r["rate"]) for r in data["runs"]] == [
        ("llm", 4.0), ("llm", 1.0), ("llm", 2.0), ("llm_colocated", 1.0)
    ]  # fmt: skip
    for run in data["runs"]:
        assert run.keys() >= RUN_KEYS
        assert run["errors"] == 1 and len(run["requests"]) == 10
        assert run["requests"][-1]["ttft"] is None  # NaN is written as null
    assert data["runs"][2]["attainment"] == pytest.approx(0.6)  # TPOT misses from i = 6
    llm, colocated = data["summary"]
    assert (llm["goodput_rps"], llm["rate"], llm["ttft_p50"]) == (2.0, 2.0, pytest.approx(0.12))
    assert llm["probed_rates"] == [4.0, 1.0, 2.0]
    assert llm["slo_scale"][0] == {"scale": 0.5, "attainment": 0.3}
    assert (colocated["goodput_rps"], colocated["rate"], colocated["slo_scale"]) == (None, 1.0, [])


def test_plots_are_written(tmp_path: Path) -> None:
    paths = write_plots(results(), SLO_, tmp_path / "plots")
    names = {"attainment_vs_rate.png", "ttft_cdf.png", "tpot_cdf.png", "slo_scale.png"}
    assert {p.name for p in paths} == names
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_openai_targets_load_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(target_module, "OPENAI_MODULE", "splitserve_tools.bench.no_such_module")
    with pytest.raises(RuntimeError, match="no_such_module"):
        target_module.make_target("openai:http://127.0.0.1:8000/v1@m", "unused")
    with pytest.raises(ValueError, match="openai:http"):
        target_module.make_target("openai:http://127.0.0.1:8000/v1", "unused")


def test_bench_command_line() -> None:
    args = parser().parse_args(
        shlex.split(
            "bench --target llm --target openai:http://h:1/v1@m --workload fixed --input-len 8 "
            "--output-len 4 --arrival gamma --cv 2 --goodput --rate-min 0.5 --rate-max 8 "
            "--slo-scale 0.5,1,2 --json o.json"
        )
    )
    assert args.target == ["llm", "openai:http://h:1/v1@m"]
    assert (args.workload, args.input_len, args.arrival, args.cv) == ("fixed", 8, "gamma", 2.0)
    assert (args.goodput, args.rate_min, args.rate_max, args.attainment) == (True, 0.5, 8.0, 0.9)
    assert args.json == Path("o.json") and args.slo_scale == "0.5,1,2"
