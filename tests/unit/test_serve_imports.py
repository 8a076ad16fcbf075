"""``splitserve serve`` without ``--openai-port`` loads neither the OpenAI stack (FastAPI, uvicorn,
gRPC, the frontend's modules) nor the tools' heavy dependencies (matplotlib, aiohttp) (issue 23).

The serve command runs for real in a process of its own (spec, kernels step, rendering, the
server object, the wait loop) with only tritonserver's start mocked: the fake server says it
exited, so the command stops where a real one would be serving.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HEAVY = (
    "fastapi",
    "uvicorn",
    "starlette",
    "pydantic",
    "jinja2",
    "grpc",
    "tritonclient",
    "openai",
    "aiohttp",
    "matplotlib",
    "transformers",
)
"""Top-level modules that serve without --openai-port has no use for."""
FRONTEND_ALLOWED = {"splitserve.openai", "splitserve.openai.options"}
"""The frontend's flags are part of serve's parser; nothing else of splitserve.openai."""

SERVE = """
import json, sys
from pathlib import Path

import splitserve.deploy.launcher as launcher
import splitserve.deploy.serve as serve

launcher.find_tritonserver = lambda: launcher.TritonInstall(
    binary=Path("/nonexistent/tritonserver"), backend_dir=Path("/nonexistent"), stub=None
)
started = []
def start(self, timeout_s=120.0):
    started.append(sorted(sys.modules))
    return self
launcher.TritonServer.start = start
launcher.TritonServer.is_alive = lambda self: False
launcher.TritonServer.stop = lambda self, timeout_s=None: None
serve.prepare_cpu_kernels = lambda: None

from splitserve_tools.cli import main

try:
    main(["serve", "--model=tiny", "--repo-dir", sys.argv[1]])
except RuntimeError as exc:
    assert "tritonserver exited" in str(exc), exc
else:
    raise AssertionError("serve returned although its server was gone")
(at_start,) = started
print(json.dumps({"at_start": at_start, "at_end": sorted(sys.modules)}))
"""


def heavy_modules(modules: list[str]) -> list[str]:
    top = [m for m in modules if m.split(".")[0] in HEAVY]
    frontend = [m for m in modules if m.startswith("splitserve.openai.")]
    return sorted(top + [m for m in frontend if m not in FRONTEND_ALLOWED])


def test_serve_without_openai_port_loads_no_frontend_nor_tool_dependencies(
    tmp_path: Path,
) -> None:
    repo = tmp_path / "repo"
    done = subprocess.run(
        [sys.executable, "-c", SERVE, str(repo)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert heavy_modules(seen["at_start"]) == []
    assert heavy_modules(seen["at_end"]) == []
    # It did get as far as rendering the repository from the packaged templates.
    for model in ("llm", "prefill", "llm_colocated"):
        assert (repo / model / "config.pbtxt").is_file()
        assert (repo / model / "1" / "model.py").is_file()


def test_the_cli_module_itself_is_light() -> None:
    code = "import json, sys, splitserve_tools.cli; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    modules = json.loads(done.stdout)
    assert heavy_modules(modules) == []
    assert "torch" not in modules
