"""GPU layouts: KIND_GPU configs rendered from the same templates as the CPU ones."""

from pathlib import Path

import pytest
from rendered_config import config_json, serving_config

from splitserve.deploy.render import render
from splitserve.deploy.serve import ServeOptions, build_spec
from splitserve.deploy.spec import DeploymentSpec, RoleSpec, default_gpu_spec, parse_gpus


def config(repo: Path, model: str) -> str:
    return (repo / model / "config.pbtxt").read_text()


def test_parse_gpus():
    assert parse_gpus("1") == (1,)
    assert parse_gpus("2,0, 1") == (0, 1, 2)
    assert parse_gpus("0-3") == (0, 1, 2, 3)
    for bad in ("", "a", "3-1", "-1"):
        with pytest.raises(ValueError):
            parse_gpus(bad)


def test_two_gpus_disagg_renders_kind_gpu_per_role(tmp_path):
    opts = ServeOptions(
        model="tiny",
        layout="both",
        device="gpu",
        prefill_gpus="0",
        decode_gpus="1",
        decode_instances=2,
        settings={"dtype": "bfloat16"},
    )
    repo = render(build_spec(opts), tmp_path)
    prefill, llm, colocated = (config(repo, m) for m in ("prefill", "llm", "llm_colocated"))
    assert "instance_group [ { count: 1 kind: KIND_GPU gpus: [ 0 ] } ]" in prefill
    assert "instance_group [ { count: 2 kind: KIND_GPU gpus: [ 1 ] } ]" in llm
    assert "instance_group [ { count: 1 kind: KIND_GPU gpus: [ 0, 1 ] } ]" in colocated
    for text in (prefill, llm):
        cfg = serving_config(text)
        assert cfg.engine.device == "cuda" and cfg.transport == "cuda_ipc"
        assert cfg.engine.dtype == "bfloat16" and cfg.cpu_cores == ""
    # Colocated hands nothing over: it keeps the default transport.
    assert serving_config(colocated).transport == "shm"
    for text, role in ((prefill, "prefill"), (llm, "decode"), (colocated, "colocated")):
        cfg = serving_config(text)
        assert cfg.role == role and cfg.engine.device == "cuda"


def test_one_gpu_still_runs_two_processes_with_ipc(tmp_path):
    repo = render(build_spec(ServeOptions(layout="disagg", device="gpu")), tmp_path)
    assert sorted(p.name for p in repo.iterdir()) == ["llm", "prefill"]
    for model in ("llm", "prefill"):
        text = config(repo, model)
        assert "kind: KIND_GPU gpus: [ 0 ]" in text
        assert serving_config(text).transport == "cuda_ipc"


def test_explicit_transport_setting_wins(tmp_path):
    base = default_gpu_spec("disagg", {"model": "tiny"})
    spec = DeploymentSpec(
        layout="disagg",
        device="gpu",
        settings=base.settings,
        prefill=RoleSpec(gpus=(0,), settings={"transport": "shm"}),
        decode=base.decode,
    )
    repo = render(spec, tmp_path)
    assert serving_config(config(repo, "prefill")).transport == "shm"
    assert serving_config(config(repo, "llm")).transport == "cuda_ipc"


def test_cpu_layout_is_unchanged(tmp_path):
    repo = render(build_spec(ServeOptions(layout="disagg", prefill_cores="0")), tmp_path)
    text = config(repo, "prefill")
    assert "kind: KIND_CPU }" in text and "gpus" not in text
    cfg = serving_config(text)
    assert cfg.cpu_cores == "0" and cfg.engine.device == "cpu" and cfg.transport == "shm"
    # Nothing on a CPU layout asks for a device or a transport: both stay at their defaults.
    data = config_json(text)
    assert data["engine"]["device"] == "cpu" and data["transport"] == "shm"


def test_bad_gpu_layouts_say_why():
    with pytest.raises(ValueError, match="needs GPU ids for the decode role"):
        DeploymentSpec(layout="disagg", device="gpu", prefill=RoleSpec(gpus=(0,)))
    with pytest.raises(ValueError, match="device is 'cpu'"):
        DeploymentSpec(layout="colocated", colocated=RoleSpec(gpus=(0,)))
    with pytest.raises(ValueError, match="distinct"):
        RoleSpec(gpus=(1, 1))
    with pytest.raises(ValueError, match="--device gpu"):
        build_spec(ServeOptions(decode_gpus="1"))
    with pytest.raises(ValueError, match="core sets"):
        build_spec(ServeOptions(device="gpu", prefill_cores="0"))
    with pytest.raises(ValueError, match="device must be"):
        build_spec(ServeOptions(device="tpu"))
