"""``splitserve plan calibrate`` end to end on ``tiny``: a quick profile, the default placement
served by a real tritonserver (``splitserve serve --plan``), the bench's two runs, the fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitserve.deploy.launcher import free_ports
from splitserve_tools.plan_calibrate import CalibrateOptions, calibrate
from splitserve_tools.planner.calibrate import GRID
from splitserve_tools.planner.commands import QUICK_POINTS, build_profile
from splitserve_tools.planner.profile import Profile
from splitserve_tools.planner.served_plan import Ports

pytestmark = pytest.mark.triton


def test_calibrate_tiny_on_the_real_server(tmp_path: Path) -> None:
    profile = build_profile("tiny", "cpu", "float32", QUICK_POINTS, cores=[1], progress=False)
    opts = CalibrateOptions(
        devices=2,
        input_len=16,
        output_len=4,
        num_requests=12,
        alone_requests=3,
        max_model_len=128,
        ports=Ports(*free_ports(3)),
        progress=False,
    )
    got = calibrate(profile, opts, tmp_path)
    assert got.serving.request_s >= 0.0
    assert got.contention.prefill in GRID and got.contention.decode in GRID
    assert got.hardware["calibration"]["placement"]["mode"] == "disagg"
    loaded = json.loads((tmp_path / "calibrate-loaded.json").read_text())
    assert loaded["runs"][0]["errors"] == 0 and len(loaded["runs"][0]["requests"]) == 12
    got.save(tmp_path / "calibrated.json")
    assert Profile.load(tmp_path / "calibrated.json") == got
