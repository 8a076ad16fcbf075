"""The deployment spec: ``serve`` checks every setting before anything starts, the spec and each
model's ServingConfig round-trip through JSON, awkward paths survive the protobuf text format,
and a plan.json serves into the spec it was written from."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import pytest
from rendered_config import config_json, parameters, serving_config, unescape

import splitserve.deploy.serve as serve_module
from splitserve.deploy.launcher import TritonServer
from splitserve.deploy.render import pbtxt_string, render
from splitserve.deploy.serve import ServeOptions, build_spec, check_paths
from splitserve.deploy.serve import start_server as real_start_server
from splitserve.deploy.spec import (
    LOCK_NAME,
    DeploymentSpec,
    RoleSpec,
    default_cpu_spec,
    default_gpu_spec,
    setting_from_text,
    setting_types,
)
from splitserve.engine_config import EngineConfig
from splitserve.serving.serving_config import CONFIG_PARAMETER, ServingConfig
from splitserve_tools.cli import main as cli_main
from splitserve_tools.planner.placement import Limits, Placement, Role
from splitserve_tools.planner.plan import Plan

AWKWARD = 'a "quoted" dir\\with back\\slashes, spaces and café ✓'


@pytest.fixture
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if ``serve`` gets as far as rendering or starting anything."""

    def reached(*_args: object, **_kwargs: object) -> None:
        pytest.fail("serve went on to start the server despite a bad setting")

    monkeypatch.setattr(serve_module, "serve_forever", reached)
    monkeypatch.setattr(serve_module, "start_server", reached)
    monkeypatch.setattr(serve_module, "render", reached)
    monkeypatch.setattr(serve_module, "prepare_cpu_kernels", reached)
    monkeypatch.setattr(TritonServer, "start", reached)


def serve_error(capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    """``splitserve serve FLAGS`` must exit with status 2; its error message."""
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["serve", *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("splitserve serve: error: "), err
    return err


# --- serve refuses bad settings before anything starts ------------------------------------------


@pytest.mark.usefixtures("nothing_starts")
def test_unknown_param_key_exits_2_naming_the_key_and_the_accepted_keys(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = serve_error(capsys, "--param", "max_num_seq=8")
    assert "'max_num_seq'" in err
    accepted = err.split("accepted:", 1)[1]
    assert {k.strip() for k in accepted.split(",")} == set(setting_types())
    for key in ("max_num_seqs", "dtype", "lease_ttl_s", "max_queue", "transport"):
        assert key in accepted


@pytest.mark.usefixtures("nothing_starts")
@pytest.mark.parametrize(
    "key", ["role", "engine", "cpu_cores", "core_lock", "lent_cores", "lend_cores"]
)
def test_placed_fields_are_not_settings(capsys: pytest.CaptureFixture[str], key: str) -> None:
    """The spec derives these from placement and lending; ``--param`` cannot set them."""
    err = serve_error(capsys, "--param", f"{key}=0")
    assert f"unknown setting {key!r}" in err


@pytest.mark.usefixtures("nothing_starts")
@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--param", "max_num_seqs=abc"], "max_num_seqs: expected an integer"),
        (["--param", "max_num_seqs=1.5"], "max_num_seqs: expected an integer"),
        (["--param", "max_num_seqs=-3"], "max_num_seqs must be positive"),
        (["--max-num-seqs", "-1"], "max_num_seqs must be positive"),
        (["--max-model-len", "0"], "max_model_len must be positive"),
        (["--param", "kv_cache_bytes=lots"], "kv_cache_bytes: expected an integer"),
        (["--param", "lease_ttl_s=-1"], "lease_ttl_s must be positive"),
        (["--param", "lease_ttl_s=nan"], "lease_ttl_s: expected a number"),
        (["--param", "max_queue=-1"], "max_queue must be >= 0"),
        (["--param", "chunked_prefill=maybe"], "chunked_prefill: expected true or false"),
        (["--param", "transport=tcp"], "transport must be one of"),
        (["--param", "prefill_routing=random"], "prefill_routing must be one of"),
        (["--param", "prefix_cache=sometimes"], "prefix_cache: expected true or false"),
        (["--param", "dtype=int8"], "dtype must be one of"),
        (["--param", "max_num_seqs"], "--param expects KEY=VALUE"),
        (["--prefill-cores", "x"], "cpu_cores"),
        (["--decode-cores", "3-1"], "cpu_cores"),
        (["--colocated-cores", "0;-1"], "cpu_cores"),
        (["--prefill-instances", "0"], "instances must be positive"),
        (["--device", "gpu", "--prefill-gpus", "x"], "GPU ids"),
        (["--device", "gpu", "--decode-cores", "0"], "core sets apply to --device cpu"),
        (["--layout", "colocated", "--lend-prefill-cores"], "lending cores needs"),
        (["--layout", "colocated", "--lend-decode-cores"], "lending cores needs"),
        (["--param", "tpot_target_s=-1"], "tpot_target_s must be positive"),
        (["--prefill-max-batch-size", "0"], "prefill_max_batch_size must be positive"),
        (["--prefill-queue-delay-us", "-1"], "prefill_queue_delay_us must be >= 0"),
    ],
)
def test_bad_values_exit_2_naming_the_field(
    capsys: pytest.CaptureFixture[str], flags: list[str], named: str
) -> None:
    assert named in serve_error(capsys, *flags)


@pytest.mark.usefixtures("nothing_starts")
def test_bad_server_cores_exit_2_naming_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    assert "server" in serve_error(capsys, "--server-cores", "x")


def test_settings_from_text_are_typed() -> None:
    assert setting_from_text("max_num_seqs", " 8 ") == 8
    assert setting_from_text("chunked_prefill", "off") is False
    assert setting_from_text("max_model_len", "none") is None
    assert setting_from_text("lease_ttl_s", "5") == 5.0
    assert setting_from_text("model", "/a path/with spaces") == "/a path/with spaces"
    opts = ServeOptions(settings={"max_num_seqs": "8", "chunked_prefill": "true"})
    spec = build_spec(opts)
    assert spec.settings["max_num_seqs"] == 8 and spec.settings["chunked_prefill"] is True
    engine = spec.serving_config("llm_colocated", Path("/repo")).engine
    assert engine.max_num_seqs == 8 and engine.chunked_prefill is True


# --- round trips --------------------------------------------------------------------------------


def specs() -> list[DeploymentSpec]:
    settings = {"model": "/ckpt", "dtype": "bfloat16", "max_model_len": 512}
    return [
        DeploymentSpec(),
        default_cpu_spec("both", settings, cores=4, lend_prefill_cores=True),
        default_cpu_spec("disagg", settings, cores=2, lend_prefill_cores=False, server_cores="1"),
        default_gpu_spec("both", settings, (0,), (1, 2), http_port=9000, host="127.0.0.1"),
        DeploymentSpec(
            layout="colocated",
            settings={**settings, "lease_ttl_s": 5.0, "max_queue": 0, "num_threads": None},
            colocated=RoleSpec(
                instances=2,
                cpu_cores="0;1",
                settings={"chunked_prefill": True, "max_num_batched_tokens": 256},
            ),
            prefill_max_batch_size=3,
            prefill_queue_delay_us=0,
            thread_pool_size=16,
        ),
    ]


@pytest.mark.parametrize("spec", specs())
def test_deployment_spec_round_trips(spec: DeploymentSpec, tmp_path: Path) -> None:
    assert DeploymentSpec.from_dict(spec.to_dict()) == spec
    through_json = json.loads(json.dumps(spec.to_dict()))
    again = DeploymentSpec.from_dict(through_json)
    assert again == spec
    for model in spec.models:
        assert again.serving_config(model, tmp_path) == spec.serving_config(model, tmp_path)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"bogus": 1}, "deployment: unknown key 'bogus'"),
        ({"layout": "split"}, "layout must be one of"),
        ({"http_port": "8000"}, "deployment.http_port: expected an integer"),
        ({"lend_prefill_cores": "yes"}, "deployment.lend_prefill_cores"),
        ({"prefill": {"instances": True}}, "deployment.prefill.instances"),
        ({"decode": {"gpus": ["0"]}}, "deployment.decode.gpus"),
        ({"decode": {"threads": 2}}, "deployment.decode: unknown key 'threads'"),
        ({"decode": 1}, "deployment.decode: expected an object"),
        ({"settings": {"max_num_seqs": "8"}}, "setting 'max_num_seqs'"),
        ({"settings": {"bogus": 1}}, "unknown setting 'bogus'"),
        ({"colocated": {"settings": {"max_queue": True}}}, "setting 'max_queue'"),
    ],
)
def test_deployment_spec_from_dict_names_what_is_wrong(change: dict, named: str) -> None:
    data = {**DeploymentSpec().to_dict(), **change}
    with pytest.raises(ValueError) as error:
        DeploymentSpec.from_dict(data)
    assert named in str(error.value)


def serving_configs() -> list[ServingConfig]:
    engine = EngineConfig(
        model=f"/ckpt/{AWKWARD}",
        dtype="float16",
        device="cuda",
        max_model_len=2048,
        num_kv_blocks=100,
        chunked_prefill=True,
        num_threads=3,
    )
    return [
        ServingConfig(role="prefill"),
        ServingConfig(role="prefill", engine=engine, transport="cuda_ipc", core_lock="/x/lock"),
        ServingConfig(
            role="decode",
            cpu_cores="2-3",
            core_lock="/x/lock",
            lent_cores="0-1",
            lease_ttl_s=2.5,
            default_max_tokens=7,
            prefill_retry_s=1.0,
            cancel_poll_s=0.5,
            metrics_interval_s=0.25,
            max_queue=0,
        ),
        ServingConfig(role="colocated", cpu_cores="0;1", prefill_model="other"),
    ]


@pytest.mark.parametrize("cfg", serving_configs())
def test_serving_config_round_trips(cfg: ServingConfig) -> None:
    assert ServingConfig.from_json(cfg.to_json()) == cfg


def test_serving_config_reads_ints_as_floats_only_for_float_fields() -> None:
    cfg = ServingConfig.from_json(json.dumps({"role": "decode", "lease_ttl_s": 5}))
    assert cfg.lease_ttl_s == 5.0 and isinstance(cfg.lease_ttl_s, float)


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"role": "decode", "bogus": 1}, "unknown key 'bogus'"),
        ({"role": "decode", "engine": {"bogus": 1}}, "engine: unknown key 'bogus'"),
        ({"role": "decode", "engine": {"max_num_seqs": "8"}}, "engine.max_num_seqs"),
        ({"role": "decode", "engine": {"max_num_seqs": True}}, "engine.max_num_seqs"),
        ({"role": "decode", "engine": {"max_num_seqs": 8.0}}, "engine.max_num_seqs"),
        ({"role": "decode", "engine": {"chunked_prefill": 1}}, "engine.chunked_prefill"),
        ({"role": "decode", "engine": {"model": 3}}, "engine.model"),
        ({"role": "decode", "engine": "tiny"}, "engine: expected an object"),
        ({"role": "decode", "max_queue": True}, "max_queue"),
        ({"role": "decode", "lease_ttl_s": "30"}, "lease_ttl_s"),
        ({"role": "decode", "lease_ttl_s": False}, "lease_ttl_s"),
        ({"role": 1}, "role"),
        ({"role": "decode", "transport": "tcp"}, "transport"),
    ],
)
def test_serving_config_from_json_rejects_unknown_keys_and_wrong_types(
    data: dict, named: str
) -> None:
    with pytest.raises(ValueError) as error:
        ServingConfig.from_json(json.dumps(data))
    assert named in str(error.value)


def test_serving_config_from_json_needs_an_object() -> None:
    for text in ("[1]", '"decode"', "3"):
        with pytest.raises(ValueError, match="expected a JSON object"):
            ServingConfig.from_json(text)


# --- rendering awkward paths --------------------------------------------------------------------


def test_pbtxt_string_escapes_what_the_text_format_needs() -> None:
    for text in ("plain", 'a "q" b', "back\\slash", "line\nbreak", "café ✓", '\\"\\n'):
        quoted = pbtxt_string(text)
        assert quoted[0] == quoted[-1] == '"'
        assert unescape(quoted[1:-1]) == text


def test_awkward_model_and_repo_paths_decode_back_exactly(tmp_path: Path) -> None:
    """``render`` itself takes any path (``start_server`` refuses repository paths the Python
    backend cannot start stubs from, and non-ASCII models: see the tests below)."""
    model = str(tmp_path / f"ckpt {AWKWARD}" / "tab\there")
    repo = tmp_path / f"repo {AWKWARD}"
    spec = default_cpu_spec("both", {"model": model}, cores=2, lend_prefill_cores=True)
    render(spec, repo)
    lock = str(repo.resolve() / LOCK_NAME)
    for name in spec.models:
        text = (repo / name / "config.pbtxt").read_text()
        assert list(parameters(text)) == [CONFIG_PARAMETER]
        data = config_json(text)
        assert data["engine"]["model"] == model
        cfg = serving_config(text)
        assert cfg == spec.serving_config(name, repo.resolve())
        assert cfg.engine.model == model
        assert cfg.core_lock == (lock if name != "llm_colocated" else "")


def test_awkward_paths_parse_with_tritons_own_config_message(tmp_path: Path) -> None:
    """What tritonserver does with config.pbtxt: protobuf text-format parse into ModelConfig."""
    model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    text_format = pytest.importorskip("google.protobuf.text_format")
    model = str(tmp_path / f"ckpt {AWKWARD}")
    repo = tmp_path / f"repo {AWKWARD}"
    spec = default_cpu_spec("disagg", {"model": model}, cores=2)
    render(spec, repo)
    for name in spec.models:
        message = text_format.Parse(
            (repo / name / "config.pbtxt").read_text(), model_config_pb2.ModelConfig()
        )
        assert message.name == name and list(message.parameters) == [CONFIG_PARAMETER]
        raw = message.parameters[CONFIG_PARAMETER].string_value
        cfg = ServingConfig.from_json(raw)
        assert cfg.engine.model == model
        assert cfg == spec.serving_config(name, repo.resolve())
        if spec.lends:
            assert cfg.core_lock == str(repo.resolve() / LOCK_NAME)


def test_start_server_refuses_paths_the_stubs_cannot_use_before_anything_starts(
    tmp_path: Path, nothing_starts: None
) -> None:
    quoted = str(tmp_path / 'ckpt a "quoted" dir\\with back\\slashes and spaces')
    spec = build_spec(ServeOptions(model=quoted))
    check_paths(spec, tmp_path / "repo")  # an awkward but ASCII model path is fine
    for name in ("repo with spaces", 'repo"quoted"', "repo\\slash", "repo$x", "repo-café"):
        with pytest.raises(ValueError, match="ASCII repository path"):
            real_start_server(spec, tmp_path / name)
    with pytest.raises(ValueError, match="use an ASCII path"):
        real_start_server(build_spec(ServeOptions(model=str(tmp_path / "café"))), tmp_path / "repo")


@pytest.mark.parametrize("case", ["repo", "model"])
def test_serve_refuses_unusable_paths_with_exit_2(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    case: str,
) -> None:
    def reached(*_args: object, **_kwargs: object) -> None:
        pytest.fail("serve went on to start the server despite an unusable path")

    # The real serve_forever and start_server, stopped before anything would start.
    monkeypatch.setattr(serve_module.signal, "signal", lambda *_args: None)
    monkeypatch.setattr(serve_module, "render", reached)
    monkeypatch.setattr(serve_module, "prepare_cpu_kernels", reached)
    monkeypatch.setattr(TritonServer, "start", reached)
    if case == "repo":
        flags = ["--repo-dir", str(tmp_path / "repo with spaces")]
    else:
        flags = ["--model", str(tmp_path / "café"), "--repo-dir", str(tmp_path / "repo")]
    err = serve_error(capsys, *flags)
    assert "ASCII" in err


# --- plan.json -> serve --plan ------------------------------------------------------------------

PLANS = [
    Plan(
        "/ckpt",
        "float32",
        "cpu",
        1024,
        Placement(
            "disagg",
            prefill=Role(1, 2),
            decode=Role(2, 1),
            limits=Limits(prefill_max_batch_size=4, prefill_queue_delay_s=0.002, max_num_seqs=64),
        ),
        1.5,
    ),
    Plan(
        f"/ckpt/{AWKWARD}",
        "bfloat16",
        "cpu",
        512,
        Placement(
            "colocated",
            colocated=Role(2, 1),
            limits=Limits(chunked_prefill=True, max_num_batched_tokens=512),
        ),
        2.0,
    ),
    Plan(
        "/ckpt",
        "float16",
        "gpu",
        2048,
        Placement("disagg", prefill=Role(1, 1), decode=Role(3, 1)),
        3.0,
    ),
]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"{p.device}-{p.placement.mode}")
def test_saved_plan_serves_into_the_same_spec(plan: Plan, tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    plan.save(path)
    spec = build_spec(ServeOptions(plan=path))
    assert spec == plan.to_spec()
    for model in spec.models:
        assert spec.serving_config(model, tmp_path) == plan.to_spec().serving_config(
            model, tmp_path
        )


def test_serve_plan_keeps_the_spec_and_applies_serving_flags(tmp_path: Path) -> None:
    plan = PLANS[0]
    plan.save(tmp_path / "plan.json")
    opts = ServeOptions(
        plan=tmp_path / "plan.json",
        lend_prefill_cores=False,
        http_port=9000,
        host="127.0.0.1",
    )
    spec = build_spec(opts)
    expected = dataclasses.replace(
        plan.to_spec(), lend_prefill_cores=False, http_port=9000, host="127.0.0.1"
    )
    assert spec == expected and not spec.lends


def test_settings_given_with_a_plan_win_over_its_per_role_limits(tmp_path: Path) -> None:
    PLANS[0].save(tmp_path / "plan.json")
    spec = build_spec(ServeOptions(plan=tmp_path / "plan.json", settings={"max_num_seqs": "8"}))
    assert spec.serving_config("llm", tmp_path).engine.max_num_seqs == 8


@pytest.mark.parametrize("with_plan", [False, True])
def test_prefill_batching_flags_reach_the_prefill_model(tmp_path: Path, with_plan: bool) -> None:
    PLANS[0].save(tmp_path / "plan.json")
    opts = ServeOptions(
        model="tiny",
        plan=tmp_path / "plan.json" if with_plan else None,
        prefill_max_batch_size=1,
        prefill_queue_delay_us=0,
    )
    spec = build_spec(opts)
    assert (spec.prefill_max_batch_size, spec.prefill_queue_delay_us) == (1, 0)
    text = (render(spec, tmp_path / "repo") / "prefill" / "config.pbtxt").read_text()
    assert "max_batch_size: 1" in text and "max_queue_delay_microseconds: 0" in text


@pytest.mark.usefixtures("nothing_starts")
def test_a_missing_plan_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "cannot read the plan" in serve_error(capsys, "--plan", str(tmp_path / "none.json"))


def test_serving_config_json_without_a_role_names_it() -> None:
    with pytest.raises(ValueError, match="missing key 'role'"):
        ServingConfig.from_json("{}")


@pytest.mark.parametrize("key", ["cancel_poll_s", "metrics_interval_s"])
def test_polling_intervals_must_be_positive(key: str) -> None:
    with pytest.raises(ValueError, match=key):
        ServingConfig(role="decode", **{key: 0.0})


@pytest.mark.usefixtures("nothing_starts")
def test_bad_deployment_in_a_plan_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = PLANS[0].to_dict()
    data["deployment"]["decode"]["settings"]["max_num_seqs"] = "64"
    (tmp_path / "plan.json").write_text(json.dumps(data))
    err = serve_error(capsys, "--plan", str(tmp_path / "plan.json"))
    assert "decode.settings: setting 'max_num_seqs' cannot be '64'" in err
    data = PLANS[0].to_dict()
    data["deployment"]["bogus"] = 1
    (tmp_path / "plan.json").write_text(json.dumps(data))
    err = serve_error(capsys, "--plan", str(tmp_path / "plan.json"))
    assert f"{tmp_path / 'plan.json'}: deployment: unknown key 'bogus'" in err


# --- one set of defaults ------------------------------------------------------------------------


def test_serving_defaults_match_the_components_they_configure() -> None:
    from splitserve.serving.loop import EngineLoop
    from splitserve.transport.leased import LeasedTransport

    defaults = {f.name: f.default for f in dataclasses.fields(ServingConfig)}
    leased = inspect.signature(LeasedTransport.__init__).parameters["lease_ttl_s"].default
    loop = inspect.signature(EngineLoop.__init__).parameters["cancel_poll_s"].default
    assert defaults["lease_ttl_s"] == leased
    assert defaults["cancel_poll_s"] == loop


def test_the_transports_a_config_accepts_are_the_registered_ones() -> None:
    from splitserve.serving.serving_config import TRANSPORTS
    from splitserve.transport import available_transports

    assert sorted(TRANSPORTS) == available_transports()
