"""``splitserve serve``'s start-up order (issue 28): nothing of the OpenAI frontend (FastAPI,
uvicorn, gRPC) is loaded before tritonserver is up; without ``--openai-port``, never."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import sys
import splitserve.deploy.serve as serve

FRONTEND = ("uvicorn", "fastapi", "grpc", "tritonclient")
companions = []

def serve_forever(spec, repo_dir=None, companion=None):
    # Where the real one has started tritonserver: nothing of the frontend loaded yet.
    assert isinstance(spec, serve.DeploymentSpec) and spec.model == "tiny", spec
    assert repo_dir is None, repo_dir
    loaded = [name for name in FRONTEND if name in sys.modules]
    assert not loaded, loaded
    companions.append(companion)

serve.serve_forever = serve_forever
from splitserve_tools.cli import main

main(["serve", "--model=tiny", *sys.argv[1:]])
(companion,) = companions
assert (companion is None) == (len(sys.argv) == 1), companion
loaded = [name for name in FRONTEND if name in sys.modules]
assert not loaded, loaded
"""


@pytest.mark.parametrize("flags", [[], ["--openai-port=9"]])
def test_serve_loads_no_frontend_before_the_server_is_up(flags: list[str]) -> None:
    subprocess.run([sys.executable, "-c", CHECK, *flags], check=True, timeout=120)
