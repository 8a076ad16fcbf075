"""Fixtures that run a real tritonserver; tests skip when none can be found."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from checkpoints import LLAMA32_SETTINGS
from hf_reference import hf_greedy
from llm_client import (
    LEASE_TTL_S,
    MAX_MODEL_LEN,
    SERVE_ENGINE,
    Reference,
    ReferenceFactory,
    splitserve_triton,
)

import splitserve_kernels
from splitserve import LLM
from splitserve.deploy.launcher import (
    TritonInstall,
    TritonServer,
    find_tritonserver,
    free_ports,
    libpython_dir,
)
from splitserve.deploy.process_group import live_group_members
from splitserve.deploy.render import render
from splitserve.deploy.spec import DeploymentSpec, default_cpu_spec, server_cores
from splitserve.engine.sampling_params import SamplingParams
from splitserve.testing.checkpoints import write_random_checkpoint
from splitserve.transport.key import generate_key, key_environ

TOY_REPO = Path(__file__).resolve().parent / "toy_repo"
START_TIMEOUT_S = 60.0
KV_SEGMENT = re.compile(r"/dev/shm/splitserve-[0-9]+-[0-9]+-[0-9a-f]+")

ServerFactory = Callable[[Path], TritonServer]


@pytest.fixture(scope="session")
def triton_install() -> TritonInstall:
    try:
        install = find_tritonserver()
        if install.stub is not None:
            libpython_dir()
    except FileNotFoundError as exc:
        pytest.skip(f"tritonserver unusable here: {exc}")
    # Build the CPU kernels here, once, rather than inside a server's ready wait (three instances
    # loading them at once would wait on one build).
    splitserve_kernels.prepare("cpu")
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


@pytest.fixture(scope="session")
def serve_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Like the root ``llama32_ckpt`` (GQA, tied embeddings, llama3 RoPE and tokenizer), with a
    4096-token context."""
    return write_random_checkpoint(
        tmp_path_factory.mktemp("serve_ckpt"),
        **LLAMA32_SETTINGS,
        max_position_embeddings=MAX_MODEL_LEN,
    )


@pytest.fixture(scope="session")
def handle_key() -> bytes:
    """The session server's handle key, known to tests that play ``llm`` towards ``prefill``."""
    return generate_key()


@pytest.fixture(scope="session")
def splitserve_server(
    triton_install: TritonInstall,
    serve_ckpt: Path,
    handle_key: bytes,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[TritonServer]:
    """One server for the session: ``llm`` + ``prefill`` + ``llm_colocated`` (layout "both").

    On teardown, after the server stopped: its KV pool segments are gone from ``/dev/shm`` and no
    Python traceback reached its log.
    """
    # As `splitserve serve` deploys it: prefill lends its core to decode between passes.
    spec = default_cpu_spec(
        "both", {"model": str(serve_ckpt), **SERVE_ENGINE}, lend_prefill_cores=True
    )
    spec = replace(spec, prefill=replace(spec.prefill, settings={"lease_ttl_s": LEASE_TTL_S}))
    server = splitserve_triton(
        render(spec, tmp_path_factory.mktemp("splitserve_repo")),
        tmp_path_factory.mktemp("triton-splitserve"),
        triton_install,
        env=key_environ(handle_key),
        # As `splitserve serve` deploys it: the server's own threads on the prefill core.
        server_cores=server_cores(spec),
    )
    server.start(START_TIMEOUT_S)
    try:
        segments = kv_segments(server)
        yield server
    finally:
        server.stop()
    assert segments, "no KV pool segment in /dev/shm"
    assert not [path for path in segments if path.exists()], "KV pool segments left behind"
    log = server.log_path
    assert log is not None
    assert "Traceback" not in log.read_text(errors="replace"), f"a model logged an exception: {log}"


@pytest.fixture
def start_splitserve(
    triton_install: TritonInstall, tmp_path: Path
) -> Iterator[Callable[[DeploymentSpec], TritonServer]]:
    """Factory of servers of this test only, on the built-in tiny model; stopped at teardown."""
    started: list[TritonServer] = []

    def start(spec: DeploymentSpec) -> TritonServer:
        n = len(started)
        server = splitserve_triton(
            render(spec, tmp_path / f"repo{n}"), tmp_path / f"triton{n}", triton_install
        )
        started.append(server)
        return server.start(START_TIMEOUT_S)

    yield start
    for server in started:
        server.stop()


def kv_segments(server: TritonServer) -> set[Path]:
    """The ``/dev/shm`` KV pool segments that the server's processes have mapped."""
    assert server.pid is not None
    segments: set[Path] = set()
    for pid in live_group_members(server.pid):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        segments.update(map(Path, KV_SEGMENT.findall(maps)))
    return segments


@pytest.fixture(scope="session")
def greedy_reference(serve_ckpt: Path) -> ReferenceFactory:
    """``reference(prompt, max_tokens, ignore_eos)``, cached."""
    llm = LLM(model=str(serve_ckpt), **{k: int(v) for k, v in SERVE_ENGINE.items()})
    cache: dict[tuple[str, int, bool], Reference] = {}

    def reference(prompt: str, max_tokens: int, ignore_eos: bool) -> Reference:
        key = (prompt, max_tokens, ignore_eos)
        if key not in cache:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
            (out,) = llm.generate(prompt, params, use_tqdm=False)
            expected = hf_greedy(
                serve_ckpt,
                out.prompt_token_ids,
                max_tokens,
                eos_token_ids=() if ignore_eos else None,
            )
            assert out.token_ids == expected, "offline engine differs from transformers"
            assert llm.tokenizer.decode(expected) == out.text
            cache[key] = Reference(out.prompt_token_ids, out.token_ids, out.text)
        return cache[key]

    return reference
