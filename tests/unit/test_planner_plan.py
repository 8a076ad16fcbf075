"""plan.json → Layout → rendered repository, ``serve --plan`` and ``plan search`` on the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_planner_profile import synthetic_profile

from splitserve.deploy.render import render
from splitserve.deploy.serve import ServeOptions, build_layout
from splitserve_tools.cli import main as cli_main
from splitserve_tools.planner.placement import Limits, Placement, Role
from splitserve_tools.planner.plan import Plan

DISAGG = Placement(
    "disagg",
    prefill=Role(1, 2),
    decode=Role(2, 1),
    limits=Limits(prefill_max_batch_size=4, prefill_queue_delay_s=0.002, max_num_seqs=64),
)


def plan_of(placement: Placement, device: str = "cpu") -> Plan:
    return Plan("/ckpt", "float32", device, 1024, placement, 1.5, {"note": "test"})


def test_plan_json_round_trip(tmp_path: Path) -> None:
    plan = plan_of(DISAGG)
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan


def test_cpu_plan_renders_pinned_instances(tmp_path: Path) -> None:
    layout = plan_of(DISAGG).to_layout()
    assert layout.layout == "disagg" and layout.device == "cpu"
    assert layout.prefill.cpu_cores == "0-1" and layout.prefill.instances == 1
    assert layout.decode.cpu_cores == "2;3" and layout.decode.instances == 2
    assert layout.engine["max_model_len"] == "1024"
    render(layout, tmp_path)
    prefill = (tmp_path / "prefill" / "config.pbtxt").read_text()
    llm = (tmp_path / "llm" / "config.pbtxt").read_text()
    assert "max_batch_size: 4" in prefill and "max_queue_delay_microseconds: 2000" in prefill
    assert 'key: "cpu_cores" value: { string_value: "0-1" }' in prefill
    assert "count: 2 kind: KIND_CPU" in llm
    assert 'key: "max_num_seqs" value: { string_value: "64" }' in llm
    assert not (tmp_path / "llm_colocated").exists()


def test_colocated_plan_carries_chunking(tmp_path: Path) -> None:
    limits = Limits(chunked_prefill=True, max_num_batched_tokens=512)
    plan = plan_of(Placement("colocated", colocated=Role(2, 1), limits=limits))
    render(plan.to_layout(), tmp_path)
    text = (tmp_path / "llm_colocated" / "config.pbtxt").read_text()
    assert 'key: "chunked_prefill" value: { string_value: "true" }' in text
    assert 'key: "cpu_cores" value: { string_value: "0;1" }' in text


def test_gpu_plan_gives_each_instance_a_gpu(tmp_path: Path) -> None:
    gpu = Placement("disagg", prefill=Role(1, 1), decode=Role(3, 1))
    layout = plan_of(gpu, "gpu").to_layout()
    assert layout.prefill.gpus == (0,) and layout.decode.gpus == (1, 2, 3)
    render(layout, tmp_path)
    assert "gpus: [ 1, 2, 3 ]" in (tmp_path / "llm" / "config.pbtxt").read_text()
    with pytest.raises(ValueError, match="tensor parallelism"):
        plan_of(Placement("colocated", colocated=Role(1, 2)), "gpu")


def test_serve_options_take_the_plan(tmp_path: Path) -> None:
    plan_of(DISAGG).save(tmp_path / "plan.json")
    opts = ServeOptions(model="/other", engine={"dtype": "bfloat16"}, plan=tmp_path / "plan.json")
    layout = build_layout(opts)
    assert layout.engine["model"] == "/other" and layout.engine["dtype"] == "bfloat16"
    assert layout.decode.cpu_cores == "2;3"


def test_serve_refuses_placement_flags_beside_a_plan(tmp_path: Path) -> None:
    plan_of(DISAGG).save(tmp_path / "plan.json")
    with pytest.raises(SystemExit, match="--decode-cores"):
        cli_main(["serve", "--plan", str(tmp_path / "plan.json"), "--decode-cores", "1"])


def test_plan_search_cli_writes_plan_and_repository(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    synthetic_profile(units=(1, 2)).save(tmp_path / "p.json")
    args = [
        *("--profile", str(tmp_path / "p.json"), "--workload", "code"),
        *("--ttft-slo", "1", "--tpot-slo", "0.05", "--cores", "2", "--num-requests", "40"),
        *("--out", str(tmp_path / "plan.json"), "--render", str(tmp_path / "repo")),
        *("--json", str(tmp_path / "all.json"), "--no-progress"),
    ]
    cli_main(["plan", "search", *args])
    out = capsys.readouterr().out
    assert "2 cores [MODELLED profile]" in out and "default layout" in out
    plan = Plan.load(tmp_path / "plan.json")
    assert plan.placement.devices == 2 and plan.predicted_goodput_rps > 0
    assert plan.context["slo"] == {"ttft_s": 1.0, "tpot_s": 0.05, "attainment": 0.9}
    model = "llm_colocated" if plan.placement.mode == "colocated" else "llm"
    assert (tmp_path / "repo" / model / "config.pbtxt").is_file()
    ranked = json.loads((tmp_path / "all.json").read_text())["budgets"][0]["ranked"]
    assert ranked[0]["goodput_rps"] == plan.predicted_goodput_rps


def test_plan_search_gpu_budgets(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    synthetic_profile(device="gpu").save(tmp_path / "g.json")
    args = [
        *("--profile", str(tmp_path / "g.json"), "--ttft-slo", "1", "--tpot-slo", "0.05"),
        *("--gpus", "1,2", "--num-requests", "40", "--no-progress"),
    ]
    cli_main(["plan", "search", *args])
    out = capsys.readouterr().out
    assert "1 GPUs [MODELLED profile]" in out and "2 GPUs [MODELLED profile]" in out
