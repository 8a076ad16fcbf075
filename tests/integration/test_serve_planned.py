"""``splitserve serve --model tiny`` with no placement flags and a profile cached for tiny on this
machine: the real CLI searches it, says what it took, and tritonserver serves exactly the
planned layout (not the default's three models), answering on its entry model."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from llm_client import answers_200, http_generate, stop_process

from splitserve.deploy.launcher import free_ports
from splitserve_tools.planner import profile_cache
from splitserve_tools.planner.cpu_id import cpu_identity
from splitserve_tools.planner.fit import DecodeFit, DecodeRange, HandoffFit, PrefillFit
from splitserve_tools.planner.plan import Plan
from splitserve_tools.planner.profile import ModelShape, Profile, UnitProfile

pytestmark = [pytest.mark.triton, pytest.mark.slow]

UP_TIMEOUT_S = 240.0
MODELS = {
    "disagg": {"prefill", "llm"},
    "colocated": {"llm_colocated"},
    "both": {"prefill", "llm", "llm_colocated"},
}
ENTRY = {"disagg": "llm", "colocated": "llm_colocated", "both": "llm"}
# The CLI as users run it, with the search's simulated runs shortened (a quick test).
SERVE = """
import sys
from splitserve_tools import serve_choice
serve_choice.SIMULATED_REQUESTS = 60
serve_choice.MIN_DURATION_S = 2.0
from splitserve_tools.cli import main
main(["serve", "--model=tiny", "--host=127.0.0.1", *sys.argv[1:]])
"""


def profile_of_this_machine() -> Profile:
    """Known step times (no measurement), as if profiled here for 1- and 2-core instances."""
    unit = UnitProfile(
        threads=1,
        prefill=PrefillFit(0.005, 1e-4, 0.0),
        decode=DecodeFit((DecodeRange(1, 0.02, 1e-3, 1e-6),)),
    )
    return Profile(
        model="tiny",
        device="cpu",
        dtype="float32",
        modelled=False,
        hardware={"cpu": "this machine", "cpu_id": cpu_identity()},
        shape=ModelShape(1024, 16, 2048, 1 << 20),  # tiny: 2048 positions
        handoff=HandoffFit(1e-4, 1e10),
        units={1: unit, 2: unit},
    )


def ready_models(http_url: str) -> set[str]:
    request = urllib.request.Request(f"{http_url}/v2/repository/index", data=b"{}")
    with urllib.request.urlopen(request, timeout=10) as response:
        index = json.loads(response.read())
    return {m["name"] for m in index if m.get("state") == "READY"}


@pytest.mark.usefixtures("triton_install")
def test_serve_without_placement_flags_serves_the_planners_choice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv(profile_cache.ENV, str(cache))
    profile_cache.store(profile_of_this_machine(), "tiny")
    http_port, grpc_port, metrics_port = free_ports(3)
    flags = [f"--http-port={http_port}", f"--grpc-port={grpc_port}"]
    flags += [f"--metrics-port={metrics_port}", "--ttft-slo=5", "--tpot-slo=0.5"]
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", SERVE, *flags], stdout=out, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + UP_TIMEOUT_S
        while not answers_200(f"{url}/v2/health/ready"):
            output = log.read_text(errors="replace")
            assert proc.poll() is None, f"serve exited with {proc.returncode}:\n{output}"
            assert time.monotonic() < deadline, f"not up in {UP_TIMEOUT_S} s:\n{output}"
            time.sleep(0.2)
        (plan_file,) = cache.glob("*/plans/*.json")
        plan = Plan.load(plan_file)
        layout = plan.placement.mode
        assert ready_models(url) == MODELS[layout] != MODELS["both"]
        answer = http_generate(url, ENTRY[layout])
        assert answer["text_output"] and answer["model_name"] == ENTRY[layout]
    finally:
        stop_process(proc, 60.0)
    output = log.read_text(errors="replace")
    assert "serving the planner's choice for chatbot" in output, output
    assert plan.placement.describe("cores") in output
