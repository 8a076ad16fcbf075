"""Find, prepare and run one tritonserver process.

Two installs are supported: the NGC container (`/opt/tritonserver`, stub already in place) and the
`nvidia-pytriton` wheel, whose Python backend needs the stub of the running Python copied next to
`libtriton_python.so`, this venv's `python3` on `PATH` and this Python's `libpython3.X.so` on
`LD_LIBRARY_PATH`.
"""

from __future__ import annotations

import http.client
import importlib.util
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

from splitserve.deploy.process_group import (
    live_group_members,
    openmp_registrations,
    stub_shm_regions,
)
from splitserve.serving.affinity import ALLOWED_CORES_ENV, format_cores, pin_process_threads
from splitserve.serving.drain import DRAIN_ENV
from splitserve.transport.cleanup import sweep_dead_owners
from splitserve.transport.key import generate_key, key_environ

LOGGER = logging.getLogger(__name__)

NGC_ROOT = Path("/opt/tritonserver")
PYTHON_BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
STUB_NAME = "triton_python_backend_stub"
DRAIN_TIMEOUT_S = 5.0
ACTIVE_REQUESTS = re.compile(
    r"^splitserve_(?:requests_active|queue_depth)\{[^}]*\} (?!0(\.0)?$)", re.M
)
"""A metrics line of an instance with active requests."""
LOG_TAIL_BYTES = 8192
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class TritonInstall:
    """Where a tritonserver lives; `stub` is None when the backend directory is ready as is."""

    binary: Path
    backend_dir: Path
    stub: Path | None
    lib_dirs: tuple[Path, ...] = ()


def find_tritonserver() -> TritonInstall:
    """Prefer the NGC container's server, else the one shipped in the nvidia-pytriton wheel."""
    ngc_binary = NGC_ROOT / "bin" / "tritonserver"
    if ngc_binary.is_file():
        return TritonInstall(binary=ngc_binary, backend_dir=NGC_ROOT / "backends", stub=None)
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"no tritonserver: neither {ngc_binary} (NGC container) nor the nvidia-pytriton wheel "
            "(pip install 'splitserve[serve]') is installed"
        )
    package = Path(next(iter(spec.submodule_search_locations)))
    dist = package / "tritonserver"
    binary = dist / "bin" / "tritonserver"
    if not binary.is_file():
        raise FileNotFoundError(f"nvidia-pytriton is installed but {binary} is missing")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / STUB_NAME
    if not stub.is_file():
        raise FileNotFoundError(f"nvidia-pytriton has no Python backend stub for Python {version}")
    libs = package.parent / "nvidia_pytriton.libs"
    return TritonInstall(
        binary=binary,
        backend_dir=dist / "backends",
        stub=stub,
        lib_dirs=(libs,) if libs.is_dir() else (),
    )


def prepare_backend_dir(install: TritonInstall, workdir: Path) -> Path:
    """Return the directory for `--backend-directory`, copying the python backend if needed."""
    if install.stub is None:
        return install.backend_dir
    backends = workdir / "backends"
    python_dir = backends / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    sources = [install.backend_dir / "python" / name for name in PYTHON_BACKEND_FILES]
    for src in [*sources, install.stub]:
        shutil.copy2(src, python_dir / src.name)
    return backends


def libpython_dir() -> Path:
    """Directory holding this Python's shared libpython, which the stub links against."""
    libdir = sysconfig.get_config_var("LIBDIR")
    soname = sysconfig.get_config_var("INSTSONAME")
    if libdir and soname and (Path(libdir) / soname).is_file():
        return Path(libdir)
    raise FileNotFoundError(
        f"no shared libpython for {sys.executable} (LIBDIR={libdir}, INSTSONAME={soname}); "
        "the Python backend stub needs a Python built with --enable-shared"
    )


def server_env(install: TritonInstall, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver: this venv's python3 first on PATH, libpython findable."""
    env = dict(os.environ if base is None else base)
    env["PATH"] = os.pathsep.join([str(Path(sys.prefix) / "bin"), env.get("PATH", os.defpath)])
    lib_dirs = [str(d) for d in install.lib_dirs]
    if install.stub is not None:
        lib_dirs.insert(0, str(libpython_dir()))
    if env.get("LD_LIBRARY_PATH"):
        lib_dirs.append(env["LD_LIBRARY_PATH"])
    if lib_dirs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(lib_dirs)
    return env


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports that were free on 127.0.0.1 a moment ago."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port() -> int:
    return free_ports(1)[0]


EXEC_WITH_PDEATHSIG = f"""\
import ctypes, os, sys
launcher, armed, *cmd = sys.argv[1:]
ctypes.CDLL(None, use_errno=True).prctl({PR_SET_PDEATHSIG}, {int(signal.SIGTERM)})
os.close(int(armed))
if os.getppid() != int(launcher):
    sys.exit("splitserve: the launcher exited before tritonserver started")
os.execv(cmd[0], cmd)
"""
"""Run as ``python -c`` with the launcher's pid, a pipe's write end and the command: asks for
SIGTERM when the parent thread exits (PR_SET_PDEATHSIG, kept across exec), says so by closing
the pipe, then becomes the command (same pid)."""


def spawn(cmd: Sequence[str], env: Mapping[str, str], output: IO[bytes]) -> subprocess.Popen[bytes]:
    """Start ``cmd`` (its binary an absolute path) in a session of its own, its output in
    ``output``; it gets SIGTERM when the calling thread exits (Linux).

    No ``preexec_fn``: with one, subprocess must fork(), which runs the pthread_atfork handlers
    of any gRPC client alive in this process (the OpenAI frontend's, a test's); with gRPC
    threads busy, the child then aborted before exec about once in 100 starts
    (``epoll_wait error: Bad file descriptor``, SIGABRT). Without one, Python 3.11 uses vfork(),
    which runs no fork handlers, and the exec wrapper sets the parent-death signal instead.
    """
    armed_r, armed_w = os.pipe()
    wrapper = [sys.executable, "-I", "-S", "-c", EXEC_WITH_PDEATHSIG, str(os.getpid())]
    try:
        proc = subprocess.Popen(
            [*wrapper, str(armed_w), *cmd],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            pass_fds=(armed_w,),
        )
    finally:
        os.close(armed_w)
    with open(armed_r, "rb") as armed:
        armed.read()  # EOF: the signal is set (or the wrapper is gone); this thread may exit
    return proc


class TritonServer:
    """One tritonserver process in its own session, so that stop() also ends its stubs.

    Each start hands the server a fresh KV-handle key (``env`` may override it), so handles of
    one server start are useless to any other.

    The server gets SIGTERM when the thread that called start() exits. Without `workdir`, a
    temporary one holds the backend copy and the log; it is removed after a clean exit only.

    With ``server_cores``, the server's own threads move to those cores once it is ready; the
    stubs, started before, keep the launcher's cores (named to them in
    ``SPLITSERVE_ALLOWED_CORES`` for any stub started later).
    """

    def __init__(
        self,
        model_repository: Path | str,
        *,
        http_port: int,
        grpc_port: int,
        metrics_port: int,
        backend_config: Mapping[str, Mapping[str, object]] | None = None,
        log_verbose: int = 0,
        extra_args: Sequence[str] = (),
        exit_timeout_s: int = 5,
        log_file: Path | None = None,
        workdir: Path | None = None,
        host: str = "127.0.0.1",
        install: TritonInstall | None = None,
        env: Mapping[str, str] | None = None,
        server_cores: set[int] | None = None,
    ) -> None:
        self.model_repository = Path(model_repository).resolve()
        self.http_port = http_port
        self.grpc_port = grpc_port
        self.metrics_port = metrics_port
        self.backend_config = dict(backend_config or {})
        self.log_verbose = log_verbose
        self.extra_args = tuple(extra_args)
        self.exit_timeout_s = exit_timeout_s
        self.host = host
        self.install = install or find_tritonserver()
        self.env = dict(env or {})
        self.allowed_cores = os.sched_getaffinity(0)
        if server_cores is not None and not server_cores <= self.allowed_cores:
            raise ValueError(
                f"server cores {format_cores(server_cores)} are not all among the cores this "
                f"process may use ({format_cores(self.allowed_cores)})"
            )
        self.server_cores = server_cores
        self._workdir = workdir
        self._owns_workdir = workdir is None
        self._given_log_file = log_file
        self._log_file: Path | None = None
        self._log: IO[bytes] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._stub_regions: set[Path] = set()
        self._drain_file: Path | None = None

    @property
    def _client_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host

    @property
    def http_url(self) -> str:
        return f"http://{self.http_address}"

    @property
    def http_address(self) -> str:
        """host:port, the form tritonclient.http expects."""
        return f"{self._client_host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """host:port, the form tritonclient.grpc expects."""
        return f"{self._client_host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self._client_host}:{self.metrics_port}/metrics"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def log_path(self) -> Path | None:
        return self._log_file

    def command(self, backend_dir: Path) -> list[str]:
        args = [
            str(self.install.binary),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={backend_dir}",
            f"--http-address={self.host}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.metrics_port}",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            f"--log-verbose={self.log_verbose}",
        ]
        for backend, settings in self.backend_config.items():
            args += [f"--backend-config={backend},{key}={value}" for key, value in settings.items()]
        return [*args, *self.extra_args]

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, max_bytes: int = LOG_TAIL_BYTES) -> str:
        if self._log_file is None or not self._log_file.is_file():
            return ""
        with self._log_file.open("rb") as log:
            log.seek(max(0, log.seek(0, os.SEEK_END) - max_bytes))
            return log.read().decode("utf-8", errors="replace")

    def start(self, timeout_s: float = 120.0) -> TritonServer:
        """Launch tritonserver and block until /v2/health/ready answers 200."""
        if self._proc is not None:
            raise RuntimeError("tritonserver already started")
        if self._workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix="splitserve-triton-"))
        self._workdir.mkdir(parents=True, exist_ok=True)
        self._log_file = self._given_log_file or self._workdir / "tritonserver.log"
        backend_dir = prepare_backend_dir(self.install, self._workdir)
        cmd = self.command(backend_dir)
        LOGGER.info("starting %s", " ".join(cmd))
        self._log = self._log_file.open("wb")
        self._drain_file = self._workdir / "drain"
        self._drain_file.unlink(missing_ok=True)
        started = time.monotonic()
        env = {
            **server_env(self.install),
            **key_environ(generate_key()),
            DRAIN_ENV: str(self._drain_file),
            ALLOWED_CORES_ENV: format_cores(self.allowed_cores),
            **self.env,
        }
        self._proc = spawn(cmd, env, self._log)
        try:
            self._wait_ready(started + timeout_s)
        except BaseException:
            self.stop()
            raise
        # Remembered now: a stub killed while serving takes its region's name with it.
        members = live_group_members(self._proc.pid)
        self._stub_regions = set(stub_shm_regions(members)).union(openmp_registrations(members))
        LOGGER.info("tritonserver ready in %.1f s (pid %d)", time.monotonic() - started, self.pid)
        if self.server_cores is not None:
            moved = pin_process_threads(self._proc.pid, self.server_cores)
            cores = format_cores(self.server_cores)
            LOGGER.info("moved tritonserver's %d threads to cores %s", moved, cores)
        return self

    def _wait_ready(self, deadline: float) -> None:
        assert self._proc is not None
        url = f"{self.http_url}/v2/health/ready"
        while True:
            code = self._proc.poll()
            if code is not None:
                raise RuntimeError(
                    f"tritonserver exited with code {code} before it was ready; "
                    f"log {self._log_file}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=1.0) as response:
                    if response.status == 200:
                        return
            except (OSError, http.client.HTTPException):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"tritonserver not ready at {url}; log {self._log_file}:\n{self.log_tail()}"
                )
            time.sleep(0.1)

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM the server, SIGKILL it after `timeout_s`, then kill what is left of its group."""
        proc = self._proc
        if proc is None:
            return
        wait_s = self.exit_timeout_s + 5.0 if timeout_s is None else timeout_s
        members = live_group_members(proc.pid)
        regions = self._stub_regions.union(stub_shm_regions(members), openmp_registrations(members))
        if proc.poll() is None:
            self._drain()
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                LOGGER.warning("tritonserver pid %d ignored SIGTERM for %.1f s", proc.pid, wait_s)
        self._kill_group(proc.pid)
        proc.wait()
        for region in sorted(regions):
            if region.exists():
                LOGGER.warning("removing leaked shared memory %s", region)
                region.unlink(missing_ok=True)
        for directory in (Path("/dev/shm"), Path(tempfile.gettempdir())):
            for path in sweep_dead_owners(directory):
                LOGGER.warning("removed %s, left by a killed model instance", path)
        self._stub_regions = set()
        LOGGER.info("tritonserver pid %d exited with code %d", proc.pid, proc.returncode)
        self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._owns_workdir and self._workdir is not None:
            if proc.returncode == 0:
                shutil.rmtree(self._workdir, ignore_errors=True)
            else:
                LOGGER.warning("keeping %s for inspection", self._workdir)
            self._workdir = None

    def _drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Ask the model instances to end their streams (``serving.drain``) and wait until the
        metrics show no active request: Triton stops a decoupled model only once it has none."""
        if self._drain_file is None:
            return
        self._drain_file.touch()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.metrics_url, timeout=1.0) as response:
                    text = response.read().decode()
            except (OSError, http.client.HTTPException):
                return
            if not ACTIVE_REQUESTS.search(text):
                return
            time.sleep(0.05)
        LOGGER.warning("model instances still had active requests after %.1f s", timeout_s)

    @staticmethod
    def _kill_group(pgid: int) -> None:
        leftovers = live_group_members(pgid)
        if not leftovers:
            return
        LOGGER.warning("killing leftover processes %s of tritonserver group %d", leftovers, pgid)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 5.0
        while live_group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)

    def __enter__(self) -> TritonServer:
        if self._proc is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
