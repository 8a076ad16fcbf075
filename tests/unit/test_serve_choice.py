"""``splitserve serve`` without placement flags takes the planner's choice from the profile
cached for the checkpoint, dtype and machine; the cache's keys; the default layout otherwise."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
from test_planner_profile import synthetic_profile

from splitserve.cli import serve_options
from splitserve.deploy.serve import build_spec
from splitserve_tools import plan_cli, serve_choice
from splitserve_tools.cli import parser
from splitserve_tools.planner import profile_cache
from splitserve_tools.planner.cpu_id import cpu_identity
from splitserve_tools.planner.placement import Placement, Role
from splitserve_tools.planner.plan import Plan
from splitserve_tools.planner.profile import Profile
from splitserve_tools.serve_choice import choose

FLAGS = ["--ttft-slo", "5", "--tpot-slo", "0.5"]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(profile_cache.ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(serve_choice, "SIMULATED_REQUESTS", 40)  # a quick search
    monkeypatch.setattr(serve_choice, "MIN_DURATION_S", 0.0)
    return tmp_path / "cache"


def measured(units: tuple[int, ...] = (1, 2)) -> Profile:
    """A synthetic profile as if measured on this machine."""
    profile = synthetic_profile(units=units)
    return dataclasses.replace(
        profile, model="tiny", modelled=False, hardware={"cpu": "this", "cpu_id": cpu_identity()}
    )


def serve_args(*flags: str):
    return parser().parse_args(["serve", "--model", "tiny", *flags])


def test_a_checkpoints_key_is_its_config_wherever_it_lies(tmp_path: Path) -> None:
    a, b, c = (tmp_path / n for n in "abc")
    for d in (a, b, c):
        d.mkdir()
    (a / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2}))
    (b / "config.json").write_text('{"num_hidden_layers": 2,\n "hidden_size": 64}')
    (c / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 3}))
    assert profile_cache.model_key(str(a)) == profile_cache.model_key(str(b))
    assert profile_cache.model_key(str(a)) != profile_cache.model_key(str(c))
    assert profile_cache.model_key("tiny") == "tiny"
    with pytest.raises(ValueError, match=r"config\.json"):
        profile_cache.model_key(str(tmp_path / "nowhere"))


def test_machine_key_names_the_part() -> None:
    part = {"vendor": "AuthenticAMD", "family": "25", "model": "17", "flags": ["avx2"]}
    key = profile_cache.machine_key("cpu", {"cpu_id": part})
    assert key.startswith("cpu-AuthenticAMD-25-17-")
    other = profile_cache.machine_key("cpu", {"cpu_id": {**part, "flags": ["avx512f"]}})
    assert other != key
    assert profile_cache.machine_key("gpu", {"gpu": "NVIDIA H200"}) == "gpu-NVIDIA_H200"


def test_store_and_lookup(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    profile = measured()
    path = profile_cache.store(profile, "tiny")
    assert path is not None and path.is_relative_to(cache)
    assert profile_cache.lookup("tiny", "float32", "cpu") == (path, path)
    assert profile_cache.lookup("tiny", "bfloat16", "cpu")[0] is None
    assert profile_cache.store(synthetic_profile(), "tiny") is None  # modelled: never cached
    monkeypatch.setenv(profile_cache.ENV, "none")
    assert profile_cache.store(profile, "tiny") is None
    assert profile_cache.lookup("tiny", "float32", "cpu") == (None, None)


def test_serve_takes_the_planners_choice_and_says_so(
    cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    profile_cache.store(measured(), "tiny")
    args = serve_args(*FLAGS)
    caplog.set_level(logging.INFO, logger="splitserve.plan")
    choose(args)
    assert args.plan is not None and args.plan.is_file()
    plan = Plan.load(args.plan)
    spec = build_spec(serve_options(args))
    assert spec.layout == plan.placement.mode and spec.model == "tiny"
    assert "serving the planner's choice for chatbot" in caplog.text
    assert plan.placement.describe("cores") in caplog.text
    assert plan.cores == tuple(sorted(os.sched_getaffinity(0)))
    # A second start reuses the search.
    again = serve_args(*FLAGS)
    choose(again)
    assert again.plan == args.plan and "searched before" in caplog.text


def test_placement_flags_no_plan_or_no_profile_serve_the_default(
    cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="splitserve.plan")
    args = serve_args(*FLAGS)
    choose(args)
    assert args.plan is None
    assert "no profile of tiny (float32) on this machine" in caplog.text
    assert "splitserve plan profile --model tiny --dtype float32" in caplog.text
    profile_cache.store(measured(), "tiny")
    for flags in (["--layout", "colocated"], ["--decode-cores", "1"], ["--no-plan"]):
        args = serve_args(*FLAGS, *flags)
        choose(args)
        assert args.plan is None, flags
    args = serve_args(*FLAGS, "--dtype", "bfloat16")  # another dtype: another profile
    choose(args)
    assert args.plan is None


def test_a_profile_without_the_budgets_fits_serves_the_default(
    cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    profile_cache.store(measured(units=(4,)), "tiny")
    caplog.set_level(logging.INFO, logger="splitserve.plan")
    args = serve_args(*FLAGS)
    choose(args)
    assert args.plan is None and "could not plan" in caplog.text


def test_a_plan_maps_its_units_onto_the_given_cores(tmp_path: Path) -> None:
    placement = Placement("disagg", prefill=Role(1, 2), decode=Role(2, 1))
    plan = Plan("/ckpt", "float32", "cpu", 256, placement, 1.0, cores=(4, 5, 8, 9))
    spec = plan.to_spec()
    assert spec.prefill.cpu_cores == "4-5" and spec.decode.cpu_cores == "8;9"
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan
    with pytest.raises(ValueError, match="takes 4 cores"):
        Plan("/ckpt", "float32", "cpu", 256, placement, 1.0, cores=(4, 5))


def test_checkpoint_profiles_key_by_shape(cache: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"hidden_size": 64}))
    profile_cache.store(measured(), str(ckpt))
    moved = tmp_path / "moved"
    shutil.copytree(ckpt, moved)
    assert profile_cache.lookup(str(moved), "float32", "cpu")[0] is not None


def test_a_search_is_keyed_by_the_profile_and_the_targets(tmp_path: Path) -> None:
    profile = tmp_path / "p.json"
    measured().save(profile)
    searched = {"workload": "chatbot", "ttft_s": 1.0, "tpot_s": 0.1, "devices": 2}
    same = profile_cache.plan_path(profile, dict(searched))
    assert same == profile_cache.plan_path(profile, searched)
    assert profile_cache.plan_path(profile, {**searched, "tpot_s": 0.2}) != same
    measured(units=(1,)).save(profile)
    assert profile_cache.plan_path(profile, searched) != same


def test_plan_profile_and_calibrate_cache_what_they_write(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = measured()
    plan_cli._cache(profile)  # what `plan profile` (not --quick) and `plan calibrate` call
    cached, _ = profile_cache.lookup("tiny", "float32", "cpu")
    assert cached is not None and Profile.load(cached) == profile
    assert "cached for `splitserve serve`" in capsys.readouterr().out
    assert not list(cache.rglob("*.tmp"))  # written through a temporary file, renamed


def test_serve_device_cpu_with_a_cached_profile(cache: Path) -> None:
    profile_cache.store(measured(), "tiny")
    args = serve_args(*FLAGS, "--device", "cpu")
    choose(args)
    assert args.plan is not None and args.device is None
    assert build_spec(serve_options(args)).device == "cpu"  # --device did not clash with --plan


def test_an_unreadable_kept_plan_is_searched_again(
    cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    profile_cache.store(measured(), "tiny")
    args = serve_args(*FLAGS)
    choose(args)
    args.plan.write_text("{ half a pla")
    again = serve_args(*FLAGS)
    choose(again)
    assert again.plan == args.plan and Plan.load(again.plan).placement is not None
