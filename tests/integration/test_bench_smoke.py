"""``splitserve bench`` end to end: a short fixed-rate run against ``llm`` and ``llm_colocated``
on the session's real tritonserver, with the checkpoint's own tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from llm_client import MAX_MODEL_LEN

from splitserve.deploy.launcher import TritonServer
from splitserve.tokenizer import load_tokenizer
from splitserve_tools.bench.main import BenchOptions, bench, build_requests

pytestmark = pytest.mark.triton

TARGETS = ["llm", "llm_colocated"]
INPUT_LEN, OUTPUT_LEN, NUM_REQUESTS = 24, 8, 8


def test_fixed_rate_bench(
    splitserve_server: TritonServer, serve_ckpt: Path, tmp_path: Path
) -> None:
    opts = BenchOptions(
        targets=TARGETS,
        url=splitserve_server.grpc_url,
        workload="fixed",
        input_len=INPUT_LEN,
        output_len=OUTPUT_LEN,
        tokenizer=str(serve_ckpt),
        max_model_len=MAX_MODEL_LEN,
        arrival="fixed",
        rate=16.0,
        num_requests=NUM_REQUESTS,
        ttft_slo=10.0,  # generous: this checks the plumbing, not this machine's speed
        tpot_slo=2.0,
        slo_scales=[0.5, 1.0, 2.0],
        json_path=tmp_path / "bench.json",
        plot_dir=tmp_path / "plots",
        progress=False,
    )
    bench(opts)
    data = json.loads(opts.json_path.read_text())

    assert [r["target"] for r in data["runs"]] == TARGETS
    for run in data["runs"]:
        assert (run["workload"], run["rate"], run["num_requests"]) == ("fixed", 16.0, NUM_REQUESTS)
        assert run["errors"] == 0, [r["error"] for r in run["requests"]]
        assert run["attainment"] == 1.0
        assert 0 < run["ttft_p50"] <= run["ttft_p90"] <= run["ttft_p99"] < 10.0
        assert 0 < run["tpot_p50"] <= run["tpot_p99"] < 2.0
        for req in run["requests"]:
            assert (req["input_len"], req["output_tokens"]) == (INPUT_LEN, OUTPUT_LEN)
    assert [s["target"] for s in data["summary"]] == TARGETS
    assert all(s["goodput_rps"] is None and len(s["slo_scale"]) == 3 for s in data["summary"])

    tokenizer = load_tokenizer(serve_ckpt)
    assert {len(tokenizer.encode(r.prompt_text)) for r in build_requests(opts)} == {INPUT_LEN}
    plots = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert plots == ["attainment_vs_rate.png", "slo_scale.png", "tpot_cdf.png", "ttft_cdf.png"]


def test_multi_turn_bench_repeats_each_turn_in_the_next(
    splitserve_server: TritonServer, serve_ckpt: Path, tmp_path: Path
) -> None:
    opts = BenchOptions(
        targets=["llm_colocated"],
        url=splitserve_server.grpc_url,
        workload="multi-turn",
        tokenizer=str(serve_ckpt),
        max_model_len=512,  # short sessions: every length scaled by 512 / 4096
        rate=4.0,
        num_requests=10,
        ttft_slo=10.0,
        tpot_slo=2.0,
        json_path=tmp_path / "bench.json",
        progress=False,
    )
    bench(opts)
    (run,) = json.loads(opts.json_path.read_text())["runs"]
    assert run["errors"] == 0, [r["error"] for r in run["requests"]]
    turns = [r["turn"] for r in run["requests"]]
    assert turns[0] == 0 and max(turns) >= 1
    tokenizer = load_tokenizer(serve_ckpt)
    requests = build_requests(opts, opts.rate)
    for req in requests:  # within a few tokens: BPE may merge across a segment boundary
        assert abs(len(tokenizer.encode(req.prompt_text)) - req.input_len) <= 4
    for req in requests:
        if req.follows is not None:
            assert req.prompt_text.startswith(requests[req.follows].prompt_text)
