"""GPU layouts: KIND_GPU configs rendered from the same templates as the CPU ones."""

import re
from pathlib import Path

import pytest

from splitserve.deploy.render import Layout, RoleSpec, default_gpu_layout, parse_gpus, render
from splitserve.deploy.serve import ServeOptions, build_layout
from splitserve.serving.serving_config import ServingConfig


def config(repo: Path, model: str) -> str:
    return (repo / model / "config.pbtxt").read_text()


def parameters(text: str) -> dict[str, str]:
    return dict(re.findall(r'key: "([^"]+)" value: \{ string_value: "([^"]*)" \}', text))


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
        engine={"dtype": "bfloat16"},
    )
    repo = render(build_layout(opts), tmp_path)
    prefill, llm, colocated = (config(repo, m) for m in ("prefill", "llm", "llm_colocated"))
    assert "instance_group [ { count: 1 kind: KIND_GPU gpus: [ 0 ] } ]" in prefill
    assert "instance_group [ { count: 2 kind: KIND_GPU gpus: [ 1 ] } ]" in llm
    assert "instance_group [ { count: 1 kind: KIND_GPU gpus: [ 0, 1 ] } ]" in colocated
    for text in (prefill, llm):
        params = parameters(text)
        assert params["device"] == "cuda" and params["transport"] == "cuda_ipc"
        assert params["dtype"] == "bfloat16" and "cpu_cores" not in params
    assert "transport" not in parameters(colocated)
    for text, role in ((prefill, "prefill"), (llm, "decode"), (colocated, "colocated")):
        cfg = ServingConfig.from_parameters({**parameters(text), "role": role})
        assert cfg.engine.device == "cuda"


def test_one_gpu_still_runs_two_processes_with_ipc(tmp_path):
    repo = render(build_layout(ServeOptions(layout="disagg", device="gpu")), tmp_path)
    assert sorted(p.name for p in repo.iterdir()) == ["llm", "prefill"]
    for model in ("llm", "prefill"):
        text = config(repo, model)
        assert "kind: KIND_GPU gpus: [ 0 ]" in text
        assert parameters(text)["transport"] == "cuda_ipc"


def test_explicit_transport_param_wins(tmp_path):
    layout = default_gpu_layout("disagg", {"model": "tiny"})
    layout = Layout(
        layout="disagg",
        device="gpu",
        engine=layout.engine,
        prefill=RoleSpec(gpus=(0,), params={"transport": "shm"}),
        decode=layout.decode,
    )
    assert parameters(config(render(layout, tmp_path), "prefill"))["transport"] == "shm"


def test_cpu_layout_is_unchanged(tmp_path):
    repo = render(build_layout(ServeOptions(layout="disagg", prefill_cores="0")), tmp_path)
    text = config(repo, "prefill")
    assert "kind: KIND_CPU }" in text and "gpus" not in text
    params = parameters(text)
    assert params["cpu_cores"] == "0" and "device" not in params and "transport" not in params


def test_bad_gpu_layouts_say_why():
    with pytest.raises(ValueError, match="needs GPU ids for the decode role"):
        Layout(layout="disagg", device="gpu", prefill=RoleSpec(gpus=(0,)))
    with pytest.raises(ValueError, match="device is 'cpu'"):
        Layout(layout="colocated", colocated=RoleSpec(gpus=(0,)))
    with pytest.raises(ValueError, match="distinct"):
        RoleSpec(gpus=(1, 1))
    with pytest.raises(ValueError, match="--device gpu"):
        build_layout(ServeOptions(decode_gpus="1"))
    with pytest.raises(ValueError, match="core sets"):
        build_layout(ServeOptions(device="gpu", prefill_cores="0"))
    with pytest.raises(ValueError, match="device must be"):
        build_layout(ServeOptions(device="tpu"))
