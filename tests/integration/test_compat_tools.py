"""Standard client tools against a real Splitserve server: perf_analyzer and genai-perf.

Opt-in: the tools install into .cache/ (hundreds of MB) and each run starts a tritonserver, so
these only run with ``SPLITSERVE_COMPAT=1``. Each test also skips, with the reason, when what its
script needs is missing on this machine (apt-get/dpkg for libb64, the perf_analyzer binary, a
network or package index for the first install).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPAT = ROOT / "scripts" / "compat"
VENV_BIN = Path(os.environ.get("SPLITSERVE_VENV", ROOT / ".venv")) / "bin"
TIMEOUT_S = 1800

pytestmark = [
    pytest.mark.triton,
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("SPLITSERVE_COMPAT") != "1",
        reason="compat smokes install tools into .cache and start tritonserver: "
        "set SPLITSERVE_COMPAT=1 to run them",
    ),
]


def _need(condition: bool, reason: str) -> None:
    if not condition:
        pytest.skip(reason)


def _perf_analyzer_prereqs() -> None:
    _need(shutil.which("bash") is not None, "no bash")
    _need(shutil.which("curl") is not None, "no curl (the scripts poll readiness with it)")
    _need((VENV_BIN / "splitserve").is_file(), f"no {VENV_BIN / 'splitserve'}")
    pa = Path(os.environ.get("PERF_ANALYZER", VENV_BIN / "perf_analyzer"))
    _need(pa.is_file(), f"no perf_analyzer at {pa} (tritonclient[all]==2.51.0 ships it)")
    have_libb64 = (
        Path("/usr/lib/x86_64-linux-gnu/libb64.so.0d").exists()
        or (ROOT / ".cache" / "compat" / "lib" / "libb64.so.0d").exists()
    )
    _need(
        have_libb64 or (shutil.which("apt-get") and shutil.which("dpkg")),
        "perf_analyzer needs libb64.so.0d and there is no apt-get/dpkg to fetch libb64-0d",
    )


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        ["bash", str(COMPAT / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.mark.parametrize("target", ["llm", "llm_colocated"])
def test_perf_analyzer_grpc_streaming(target: str) -> None:
    _perf_analyzer_prereqs()
    proc = _run("perf_analyzer.sh", "--target", target, "--max-tokens", "8", "--requests", "4")
    assert "perf_analyzer.sh: OK" in proc.stdout


@pytest.mark.parametrize("backend", ["vllm", "tensorrtllm"])
def test_genai_perf_kserve(backend: str) -> None:
    _perf_analyzer_prereqs()
    proc = _run("genai_perf.sh", "--backend", backend, "--requests", "4", "--output-tokens", "8")
    assert "genai_perf.sh: OK" in proc.stdout
