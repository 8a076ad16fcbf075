"""Fixtures that run a real tritonserver; tests skip when none can be found."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from splitserve.deploy.launcher import (
    TritonInstall,
    TritonServer,
    find_tritonserver,
    free_ports,
    libpython_dir,
)

TOY_REPO = Path(__file__).resolve().parent / "toy_repo"
START_TIMEOUT_S = 60.0

ServerFactory = Callable[[Path], TritonServer]


@pytest.fixture(scope="session")
def triton_install() -> TritonInstall:
    try:
        install = find_tritonserver()
        if install.stub is not None:
            libpython_dir()
    except FileNotFoundError as exc:
        pytest.skip(f"tritonserver unusable here: {exc}")
    return install


@pytest.fixture(scope="session")
def make_triton_server(
    triton_install: TritonInstall, tmp_path_factory: pytest.TempPathFactory
) -> ServerFactory:
    """Factory of unstarted servers on free ports; the caller starts and stops them."""

    def make(repo_dir: Path) -> TritonServer:
        http_port, grpc_port, metrics_port = free_ports(3)
        return TritonServer(
            repo_dir,
            http_port=http_port,
            grpc_port=grpc_port,
            metrics_port=metrics_port,
            workdir=tmp_path_factory.mktemp(f"triton-{repo_dir.name}"),
            install=triton_install,
        )

    return make


@pytest.fixture(scope="session")
def triton_server(make_triton_server: ServerFactory) -> Iterator[ServerFactory]:
    """Factory: `triton_server(repo_dir)` starts one shared server per repository per session."""
    servers: dict[Path, TritonServer] = {}

    def start(repo_dir: Path) -> TritonServer:
        key = repo_dir.resolve()
        if key not in servers:
            servers[key] = make_triton_server(key).start(START_TIMEOUT_S)
        return servers[key]

    yield start
    for server in servers.values():
        server.stop()


@pytest.fixture(scope="session")
def toy_repo() -> Path:
    return TOY_REPO


@pytest.fixture(scope="session")
def toy_server(triton_server: ServerFactory, toy_repo: Path) -> TritonServer:
    return triton_server(toy_repo)
