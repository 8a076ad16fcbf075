"""The wheel works on its own (issue 23): ``pip wheel .`` carries the model-repository templates
and the C++ kernel sources; installed (not editable) into a fresh venv and run from a directory
outside the checkout, ``splitserve serve --model tiny`` serves, on its compiled CPU kernels.

The fresh venv gets the heavy dependencies (torch, tritonserver, ...) from the running
environment without downloading them again: the wheel goes in with ``--no-deps``, and one ``.pth``
line appends the running environment's site-packages to the fresh venv's path. A plain path line
only appends the directory; ``.pth`` files inside it are not run, so the editable install's
finder (``__editable__.splitserve-*.pth``) never loads there, and the venv's own site-packages
comes first: the wheel's splitserve is the one imported (checked).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from llm_client import answers_200, http_generate, stop_process

from splitserve.deploy.launcher import find_tritonserver, free_ports

pytestmark = [pytest.mark.triton, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "backends", "client", "kernels", "tools")
"""What the wheel is built from: copied, so that no build/ or egg-info lands in the checkout."""
TEMPLATES = REPO / "backends" / "splitserve" / "deploy" / "templates"
CPU_KERNELS = REPO / "kernels" / "splitserve_kernels" / "cpu"
PACKAGES = ("splitserve", "splitserve_client", "splitserve_kernels", "splitserve_tools")
READY_TIMEOUT_S = 900.0
"""A cold build of the CPU kernels (minutes on two busy cores), then the server's start."""
STOP_TIMEOUT_S = 60.0
KERNELS_SO = "splitserve_cpu_kernels"


@dataclass(frozen=True)
class Installed:
    venv: Path
    site: Path
    env: dict[str, str]
    """For every command run in the venv: no PYTHONPATH, a fresh TORCH_EXTENSIONS_DIR."""
    cwd: Path
    """Outside the checkout."""

    def python(self, code: str, timeout: float = 600) -> str:
        return run([str(self.venv / "bin" / "python"), "-c", code], self, timeout).stdout


def run(cmd: list[str], where: Installed | None = None, timeout: float = 600):
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=where.env if where else None,
        cwd=where.cwd if where else None,
    )
    assert done.returncode == 0, f"{cmd}:\n{done.stdout}\n{done.stderr}"
    return done


def wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("wheel_src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    out = tmp_path_factory.mktemp("dist")
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    run([*pip_wheel, "-w", str(out), str(src)], timeout=300)
    (built,) = out.glob("splitserve-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("wheel_venv")
    venv = root / "venv"
    run([sys.executable, "-m", "venv", str(venv)], timeout=300)
    python = str(venv / "bin" / "python")
    run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], timeout=300)
    site = Path(
        run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip()
    )
    # The heavy dependencies: this environment's site-packages, appended after the venv's own.
    deps = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (site / "zz_splitserve_test_deps.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env["TORCH_EXTENSIONS_DIR"] = str(root / "torch_extensions")
    cwd = root / "cwd"
    cwd.mkdir()
    return Installed(venv=venv, site=site.resolve(), env=env, cwd=cwd)


def test_the_wheel_carries_the_templates_and_kernel_sources(wheel: Path) -> None:
    names = wheel_names(wheel)
    templates = {
        "splitserve/deploy/templates/" + p.relative_to(TEMPLATES).as_posix()
        for p in TEMPLATES.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    kernels = {
        f"splitserve_kernels/cpu/{p.name}"
        for p in CPU_KERNELS.iterdir()
        if p.suffix in (".cpp", ".h")
    }
    assert "splitserve/deploy/templates/generate_io.pbtxt" in templates
    assert "splitserve_kernels/cpu/module.cpp" in kernels
    assert templates <= names, sorted(templates - names)
    assert kernels <= names, sorted(kernels - names)
    # The templates' model.py files are data, not packages of their own.
    assert not [
        n
        for n in names
        if n.startswith("splitserve/deploy/templates/") and n.endswith("__init__.py")
    ]


def test_the_wheel_is_what_the_venv_imports(installed: Installed) -> None:
    code = (
        "import json, sys\n"
        f"mods = {{m: __import__(m).__file__ for m in {PACKAGES!r}}}\n"
        "finders = [repr(f) for f in sys.meta_path if 'editable' in repr(f).lower()]\n"
        "from splitserve.deploy.render import templates_dir\n"
        "print(json.dumps({'mods': mods, 'finders': finders, 'templates': str(templates_dir())}))\n"
    )
    seen = json.loads(installed.python(code))
    for name, path in seen["mods"].items():
        assert Path(path).resolve().is_relative_to(installed.site), (name, path)
        assert not Path(path).resolve().is_relative_to(REPO), (name, path)
    assert seen["finders"] == []
    assert Path(seen["templates"]).resolve().is_relative_to(installed.site)


@dataclass(frozen=True)
class Serving:
    proc: subprocess.Popen[bytes]
    http_url: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def serving(installed: Installed) -> Iterator[Serving]:
    try:
        find_tritonserver()
    except FileNotFoundError as exc:
        pytest.skip(f"no tritonserver here: {exc}")
    http_port, grpc_port, metrics_port = free_ports(3)
    log = installed.cwd / "serve.log"
    cmd = [
        str(installed.venv / "bin" / "splitserve"),
        "serve",
        "--model",
        "tiny",
        "--host=127.0.0.1",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=installed.env, cwd=installed.cwd
        )
    running = Serving(proc, f"http://127.0.0.1:{http_port}", log)
    try:
        started = time.monotonic()
        while not answers_200(f"{running.http_url}/v2/health/ready"):
            assert proc.poll() is None, f"serve exited with {proc.returncode}:\n{running.output()}"
            assert time.monotonic() - started < READY_TIMEOUT_S, running.output()
            time.sleep(0.5)
        print(
            f"wheel's `splitserve serve --model tiny` ready in {time.monotonic() - started:.0f} s"
        )
        yield running
    finally:
        stop_process(proc, STOP_TIMEOUT_S)


def mapped_kernels(pid: int) -> list[str]:
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return []
    return sorted({line.split()[-1] for line in maps.splitlines() if KERNELS_SO in line})


def test_the_installed_wheel_serves_tiny_on_its_compiled_kernels(
    installed: Installed, serving: Serving
) -> None:
    answers = {model: http_generate(serving.http_url, model) for model in ("llm", "llm_colocated")}
    for model, answer in answers.items():
        assert isinstance(answer.get("text_output"), str) and answer["text_output"], (model, answer)
    output = serving.output()
    ext_dir = installed.env["TORCH_EXTENSIONS_DIR"]
    # serve built the kernels (from the wheel's sources, into this TORCH_EXTENSIONS_DIR) ...
    assert f"CPU kernels loaded from {ext_dir}" in output, output
    assert "CPU kernels unavailable" not in output, output
    # ... and the model instances run on them: every stub maps the compiled module.
    stubs = [
        p
        for p in psutil.Process(serving.proc.pid).children(recursive=True)
        if "triton_python_backend_stub" in " ".join(p.cmdline() or [p.name()])
    ]
    assert stubs, output
    for stub in stubs:
        maps = mapped_kernels(stub.pid)
        assert maps and all(m.startswith(ext_dir) for m in maps), (stub.pid, maps)
    server_log = next(
        (line.split(None, 1)[1] for line in output.splitlines() if line.strip().startswith("log ")),
        None,
    )
    if server_log and Path(server_log.strip()).is_file():
        assert "CPU kernels unavailable" not in Path(server_log.strip()).read_text(errors="replace")
    # What the package itself reports, in the venv.
    status = installed.python("import splitserve_kernels; print(splitserve_kernels.cpu_status())")
    assert status.strip().startswith(f"compiled {ext_dir}"), status
