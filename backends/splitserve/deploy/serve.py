"""``splitserve serve``: render a repository for a layout, start tritonserver, wait for a signal."""

from __future__ import annotations

import logging
import signal
import tempfile
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

from splitserve.deploy.launcher import TritonServer
from splitserve.deploy.render import LAYOUTS, Layout, RoleSpec, default_cpu_layout, render

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeOptions:
    model: str = "tiny"
    layout: str = "both"
    engine: dict[str, str] = field(default_factory=dict)
    prefill_instances: int = 1
    decode_instances: int = 1
    colocated_instances: int = 1
    prefill_cores: str | None = None
    decode_cores: str | None = None
    colocated_cores: str | None = None
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    host: str = "0.0.0.0"
    repo_dir: Path | None = None
    thread_pool_size: int = 128


def build_layout(opts: ServeOptions) -> Layout:
    base = default_cpu_layout(opts.layout, {"model": opts.model, **opts.engine})

    def role(spec: RoleSpec, instances: int, cores: str | None) -> RoleSpec:
        return replace(
            spec, instances=instances, cpu_cores=spec.cpu_cores if cores is None else cores
        )

    return replace(
        base,
        prefill=role(base.prefill, opts.prefill_instances, opts.prefill_cores),
        decode=role(base.decode, opts.decode_instances, opts.decode_cores),
        colocated=role(base.colocated, opts.colocated_instances, opts.colocated_cores),
    )


def start_server(opts: ServeOptions) -> TritonServer:
    repo = opts.repo_dir or Path(tempfile.mkdtemp(prefix="splitserve-repo-"))
    render(build_layout(opts), repo)
    server = TritonServer(
        repo,
        http_port=opts.http_port,
        grpc_port=opts.grpc_port,
        metrics_port=opts.metrics_port,
        host=opts.host,
        backend_config={"python": {"thread-pool-size": opts.thread_pool_size}},
    )
    return server.start()


def serve_forever(opts: ServeOptions) -> None:
    """Run until SIGINT/SIGTERM, then stop the server (and its stubs) cleanly."""
    if opts.repo_dir is None:
        with tempfile.TemporaryDirectory(prefix="splitserve-repo-") as tmp:
            serve_forever(replace(opts, repo_dir=Path(tmp)))
        return
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server = start_server(opts)
    models = ", ".join(LAYOUTS[opts.layout])
    print(f"splitserve: serving {opts.model!r} ({opts.layout}: {models})", flush=True)
    print(f"  HTTP     {server.http_url}  (POST /v2/models/llm/generate_stream)", flush=True)
    print(f"  gRPC     {server.grpc_url}", flush=True)
    print(f"  metrics  {server.metrics_url}", flush=True)
    print(f"  log      {server.log_path}", flush=True)
    try:
        while not stop.wait(1.0):
            if not server.is_alive():
                raise RuntimeError(f"tritonserver exited:\n{server.log_tail()}")
    finally:
        print("splitserve: shutting down", flush=True)
        server.stop()
