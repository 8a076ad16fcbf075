"""`serve --role prefill|decode`: the spec of a server that runs one phase of the split."""

import argparse
import os
from pathlib import Path

import pytest

from splitserve.cli import add_runtime_parsers, serve_options
from splitserve.deploy.serve import build_spec, check_paths, server_key
from splitserve.deploy.spec import DeploymentSpec, RoleSpec
from splitserve.serving.serving_config import ServingConfig
from splitserve.transport.key import KEY_ENV


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "handle.key"
    path.write_text("ab" * 32 + "\n")
    path.chmod(0o600)
    return path


def spec_of(*flags: str) -> DeploymentSpec:
    parser = argparse.ArgumentParser()
    add_runtime_parsers(parser.add_subparsers())
    return build_spec(serve_options(parser.parse_args(["serve", *flags])))


def test_prefill_server_runs_only_prefill_on_every_core(key_file):
    spec = spec_of("--role", "prefill", "--key-file", str(key_file), "--advertise-host", "10.1.0.2")
    assert spec.models == ("prefill",) and spec.layout == "disagg"
    cfg = spec.serving_config("prefill", Path("/"))
    assert cfg.transport == "nixl" and cfg.advertise_host == "10.1.0.2"
    assert spec.prefill.cpu_cores == spec.colocated.cpu_cores  # all cores, not half
    assert not spec.lends


def test_decode_server_calls_remote_prefill(key_file):
    spec = spec_of(
        "--role", "decode", "--key-file", str(key_file),
        "--prefill-url", "10.1.0.2:8001", "--prefill-url", "10.1.0.3:8001",
    )  # fmt: skip
    assert spec.models == ("llm",)
    cfg = spec.serving_config("llm", Path("/"))
    assert cfg.remote_prefill and cfg.prefill_urls == "10.1.0.2:8001,10.1.0.3:8001"
    assert cfg.transport_options()["transfer_timeout_s"] == cfg.kv_transfer_timeout_s
    dns = spec_of("--role", "decode", "--key-file", str(key_file), "--prefill-dns", "pf:8001")
    assert dns.serving_config("llm", Path("/")).prefill_dns == "pf:8001"


def test_decode_server_fails_lost_handoffs_unless_told_to_recompute(key_file):
    flags = ("--role", "decode", "--key-file", str(key_file), "--prefill-url", "h:8001")
    cfg = spec_of(*flags).serving_config("llm", Path("/"))
    assert cfg.kv_load_failure_policy == "fail"
    told = spec_of(*flags, "--param", "kv_load_failure_policy=recompute")
    assert told.serving_config("llm", Path("/")).kv_load_failure_policy == "recompute"
    assert spec_of().serving_config("llm", Path("/")).kv_load_failure_policy == "recompute"
    with pytest.raises(ValueError, match="kv_load_failure_policy"):
        spec_of("--param", "kv_load_failure_policy=retry")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--role", "prefill"], "needs --key-file"),
        (["--role", "decode", "--key-file", "K"], "needs --prefill-url"),
        (["--prefill-url", "h:1"], "apply to --role decode"),
        (["--role", "prefill", "--key-file", "K", "--prefill-dns", "x"], "apply to --role decode"),
        (["--role", "decode", "--key-file", "K", "--prefill-url", "a:1", "--prefill-dns", "b"],
         "exclude each other"),
        (["--role", "prefill", "--key-file", "K", "--layout", "colocated"], "layout with prefill"),
    ],
)  # fmt: skip
def test_bad_split_flags_name_what_is_wrong(flags, message, key_file):
    flags = [str(key_file) if f == "K" else f for f in flags]
    with pytest.raises(ValueError, match=message):
        spec_of(*flags)


def test_key_file_is_read_and_checked(key_file, tmp_path):
    spec = spec_of("--role", "prefill", "--key-file", str(key_file))
    assert server_key(spec) == {KEY_ENV: "ab" * 32}
    key_file.chmod(0o640)
    with pytest.raises(ValueError, match=r"--key-file.*mode 640"):
        check_paths(spec, tmp_path / "repo")
    os.unlink(key_file)
    with pytest.raises(ValueError, match=r"--key-file.*cannot open"):
        check_paths(spec, tmp_path / "repo")
    assert server_key(spec_of()) == {}


def test_split_spec_round_trips_through_json(key_file):
    spec = spec_of("--role", "decode", "--key-file", str(key_file), "--prefill-dns", "pf")
    assert DeploymentSpec.from_dict(spec.to_dict()) == spec


def test_remote_settings_belong_to_decode():
    with pytest.raises(ValueError, match="decode-role setting"):
        DeploymentSpec(settings={"prefill_urls": "a:1"})
    with pytest.raises(ValueError, match="decode role"):
        ServingConfig(role="prefill", prefill_urls="a:1")
    spec = DeploymentSpec(
        layout="disagg",
        server_role="decode",
        key_file="/k",
        decode=RoleSpec(settings={"prefill_urls": "a:1"}),
    )
    assert spec.models == ("llm",)


def test_openai_port_needs_llm_on_this_server(key_file, capsys):
    from splitserve_tools.cli import main as cli_main

    with pytest.raises(SystemExit) as exit_info:
        cli_main(["serve", "--role", "prefill", "--key-file", str(key_file), "--openai-port", "9"])
    assert exit_info.value.code == 2
    assert "--openai-port needs a server with llm" in capsys.readouterr().err


def test_fp8_transfer_is_a_nixl_setting(key_file):
    spec = spec_of(
        "--role", "prefill", "--key-file", str(key_file), "--kv-transfer-dtype", "fp8"
    )  # fmt: skip
    cfg = spec.serving_config("prefill", Path("/"))
    assert cfg.kv_transfer_dtype == "fp8" and cfg.transport_options()["transfer_dtype"] == "fp8"
    with pytest.raises(ValueError, match="fp8 needs transport nixl"):
        spec_of("--kv-transfer-dtype", "fp8")
