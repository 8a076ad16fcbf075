"""plan.json → deployment spec → rendered repository, ``serve --plan`` and ``plan search``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rendered_config import serving_config
from test_planner_profile import synthetic_profile

from splitserve.deploy.render import render
from splitserve.deploy.serve import ServeOptions, build_spec
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


def test_plan_json_carries_its_deployment_spec(tmp_path: Path) -> None:
    plan = plan_of(DISAGG)
    plan.save(tmp_path / "plan.json")
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["deployment"] == json.loads(json.dumps(plan.to_spec().to_dict()))


def test_cpu_plan_renders_pinned_instances(tmp_path: Path) -> None:
    spec = plan_of(DISAGG).to_spec()
    assert spec.layout == "disagg" and spec.device == "cpu"
    assert spec.prefill.cpu_cores == "0-1" and spec.prefill.instances == 1
    assert spec.decode.cpu_cores == "2;3" and spec.decode.instances == 2
    assert spec.settings["max_model_len"] == 1024
    render(spec, tmp_path)
    prefill = (tmp_path / "prefill" / "config.pbtxt").read_text()
    llm = (tmp_path / "llm" / "config.pbtxt").read_text()
    assert "max_batch_size: 4" in prefill and "max_queue_delay_microseconds: 2000" in prefill
    assert serving_config(prefill).cpu_cores == "0-1"
    assert "count: 2 kind: KIND_CPU" in llm
    decode = serving_config(llm)
    assert decode.engine.max_num_seqs == 64 and decode.engine.max_model_len == 1024
    assert decode.engine.model == "/ckpt" and decode.engine.dtype == "float32"
    assert not (tmp_path / "llm_colocated").exists()


def test_colocated_plan_carries_chunking(tmp_path: Path) -> None:
    limits = Limits(chunked_prefill=True, max_num_batched_tokens=512)
    plan = plan_of(Placement("colocated", colocated=Role(2, 1), limits=limits))
    render(plan.to_spec(), tmp_path)
    cfg = serving_config((tmp_path / "llm_colocated" / "config.pbtxt").read_text())
    assert cfg.engine.chunked_prefill is True
    assert cfg.engine.max_num_batched_tokens == 512
    assert cfg.cpu_cores == "0;1"


def test_gpu_plan_gives_each_instance_a_gpu(tmp_path: Path) -> None:
    gpu = Placement("disagg", prefill=Role(1, 1), decode=Role(3, 1))
    spec = plan_of(gpu, "gpu").to_spec()
    assert spec.prefill.gpus == (0,) and spec.decode.gpus == (1, 2, 3)
    render(spec, tmp_path)
    assert "gpus: [ 1, 2, 3 ]" in (tmp_path / "llm" / "config.pbtxt").read_text()
    with pytest.raises(ValueError, match="tensor parallelism"):
        plan_of(Placement("colocated", colocated=Role(1, 2)), "gpu")


def test_serve_options_take_the_plan(tmp_path: Path) -> None:
    plan_of(DISAGG).save(tmp_path / "plan.json")
    opts = ServeOptions(model="/other", settings={"dtype": "bfloat16"}, plan=tmp_path / "plan.json")
    spec = build_spec(opts)
    assert spec.settings["model"] == "/other" and spec.settings["dtype"] == "bfloat16"
    assert spec.decode.cpu_cores == "2;3"
    assert build_spec(ServeOptions(plan=tmp_path / "plan.json")).model == "/ckpt"


def test_serve_refuses_a_plan_without_a_deployment(tmp_path: Path) -> None:
    data = plan_of(DISAGG).to_dict()
    del data["deployment"]
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="has no deployment"):
        build_spec(ServeOptions(plan=tmp_path / "plan.json"))


def test_serve_refuses_placement_flags_beside_a_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan_of(DISAGG).save(tmp_path / "plan.json")
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["serve", "--plan", str(tmp_path / "plan.json"), "--decode-cores", "1"])
    assert exit_info.value.code == 2
    assert "--decode-cores" in capsys.readouterr().err


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


def test_plan_search_prices_a_slow_link_between_nodes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    synthetic_profile(units=(1, 2)).save(tmp_path / "p.json")
    args = [
        *("--profile", str(tmp_path / "p.json"), "--workload", "summarization"),
        *("--ttft-slo", "2", "--tpot-slo", "0.05", "--cores", "2", "--num-requests", "40"),
        "--no-progress",
    ]

    def best_disagg(extra: list[str], name: str) -> float:
        cli_main(["plan", "search", *args, *extra, "--json", str(tmp_path / name)])
        ranked = json.loads((tmp_path / name).read_text())["budgets"][0]["ranked"]
        return max(r["goodput_rps"] for r in ranked if r["placement"]["mode"] == "disagg")

    local = best_disagg([], "local.json")
    slow = best_disagg(["--link-gbit", "0.01", "--link-latency-ms", "5"], "link.json")
    assert "handoff over a 0.01 Gbit/s link" in capsys.readouterr().out
    assert slow < local
    rows = [
        {"rate_gbit": 0.01, "tokens": t, "bytes": t * 4096, "seconds": 5e-3 + t * 4096 / 1.25e6}
        for t in (128, 1024)
    ]
    fp8 = [{**r, "encoding": "fp8", "seconds": 5e-3 + r["bytes"] / 2.5e6} for r in rows]
    (tmp_path / "measured.json").write_text(json.dumps(rows + fp8))
    measured = ["--link-json", str(tmp_path / "measured.json"), "--link-rate", "0.01"]
    assert best_disagg(measured, "measured_link.json") == pytest.approx(slow, rel=0.05)
    assert "raw handoff measured over the link" in capsys.readouterr().out
    halved = best_disagg([*measured, "--kv-transfer-dtype", "fp8"], "fp8_link.json")
    assert "fp8 handoff measured over the link" in capsys.readouterr().out
    assert halved > slow


def test_plan_search_k8s_writes_the_plans_replicas_and_cores(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from splitserve_tools.plan_cli import write_k8s
    from splitserve_tools.planner.placement import Placement, Role

    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # deploy/k8s of this checkout
    disagg = Placement("disagg", prefill=Role(3, 2), decode=Role(2, 4))
    write_k8s(disagg, False, tmp_path / "overlay", None)
    text = (tmp_path / "overlay" / "kustomization.yaml").read_text()
    assert "splitserve-prefill" in text and "count: 3" in text and "count: 2" in text
    assert "wrote the Kubernetes overlay" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="colocated"):
        write_k8s(Placement("colocated", colocated=Role(1, 4)), False, tmp_path / "c", None)
