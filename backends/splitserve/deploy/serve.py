"""``splitserve serve``: render a repository for a layout, start tritonserver, wait for a signal."""

from __future__ import annotations

import logging
import signal
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from splitserve.deploy.launcher import TritonServer
from splitserve.deploy.render import (
    LAYOUTS,
    Layout,
    RoleSpec,
    default_cpu_layout,
    default_gpu_layout,
    default_server_cores,
    lend_prefill_cores,
    lending_refusal,
    parse_gpus,
    render,
)
from splitserve.serving.affinity import parse_cores

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
    device: str = "cpu"
    """``cpu`` (KIND_CPU, shm handoff) or ``gpu`` (KIND_GPU, CUDA IPC handoff)."""
    prefill_gpus: str | None = None
    """GPU ids (``"0"``, ``"0,1"``, ``"0-3"``); the ``*_instances`` counts are per GPU."""
    decode_gpus: str | None = None
    colocated_gpus: str | None = None
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    host: str = "0.0.0.0"
    repo_dir: Path | None = None
    thread_pool_size: int = 128
    lend_prefill_cores: bool | None = None
    """Decode also steps on the prefill cores while prefill is idle (``serving.core_lend``):
    True requires it (CPU, one prefill and one decode instance on disjoint cores), False turns
    it off, None (default) lends wherever the layout allows."""
    server_cores: str | None = None
    """Cores for tritonserver's own threads (front ends, backend threads), e.g. ``"0"``; ``all``
    leaves them anywhere; None (default) puts them on the prefill cores of a CPU layout
    (``render.default_server_cores``)."""
    plan: Path | None = None
    """A ``plan.json`` from ``splitserve plan search``: it sets the layout, placement and batching
    limits; ``model`` and ``engine`` still apply (they override the plan's)."""


def layout_from_plan(opts: ServeOptions) -> Layout:
    from splitserve_tools.planner.plan import Plan

    assert opts.plan is not None
    layout = Plan.load(opts.plan).to_layout(opts.model)
    return replace(layout, engine={**layout.engine, **opts.engine})


def build_layout(opts: ServeOptions) -> Layout:
    if opts.plan is not None:
        return layout_from_plan(opts)
    engine = {"model": opts.model, **opts.engine}
    if opts.device == "gpu":
        core_flags = (opts.prefill_cores, opts.decode_cores, opts.colocated_cores)
        if any(flag is not None for flag in core_flags):
            raise ValueError("core sets apply to --device cpu; GPU instances take GPU ids")
        base = default_gpu_layout(
            opts.layout,
            engine,
            parse_gpus(opts.prefill_gpus or "0"),
            parse_gpus(opts.decode_gpus or "0"),
            parse_gpus(opts.colocated_gpus) if opts.colocated_gpus else None,
        )
    elif opts.device == "cpu":
        gpu_flags = (opts.prefill_gpus, opts.decode_gpus, opts.colocated_gpus)
        if any(flag is not None for flag in gpu_flags):
            raise ValueError("GPU ids need --device gpu")
        base = default_cpu_layout(opts.layout, engine)
    else:
        raise ValueError(f"device must be 'cpu' or 'gpu', got {opts.device!r}")

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


def check_gpu_layout(layout: Layout) -> None:
    """Fail early, with the reason, when the layout's GPUs do not exist or when a decode GPU
    cannot map a prefill GPU's memory (CUDA IPC between two GPUs needs peer access)."""
    import torch

    if not torch.cuda.is_available():
        log.warning("cannot check the GPU layout here: torch sees no CUDA device")
        return
    count = torch.cuda.device_count()
    used = {g for name in ("prefill", "decode", "colocated") for g in layout.role(name).gpus}
    missing = sorted(g for g in used if g >= count)
    if missing:
        raise ValueError(f"GPUs {missing} do not exist here ({count} visible)")
    if "prefill" not in LAYOUTS[layout.layout]:
        return
    for decode in layout.decode.gpus:
        for prefill in layout.prefill.gpus:
            if decode != prefill and not torch.cuda.can_device_access_peer(decode, prefill):
                raise ValueError(
                    f"decode GPU {decode} has no peer access to prefill GPU {prefill}, which "
                    "CUDA IPC needs: pick GPUs linked by NVLink or PCIe P2P, or share one GPU"
                )


def prepare_cpu_kernels() -> None:
    """Build the CPU kernels here, once, before the instances start: each would otherwise wait
    on the same build inside the server's start-up timeout."""
    import splitserve_kernels

    log.info("preparing the CPU kernels (built on first use, about 40 s)")
    splitserve_kernels.prepare("cpu")


def server_cores(opts: ServeOptions, layout: Layout) -> set[int] | None:
    if opts.server_cores is None:
        return default_server_cores(layout)
    if opts.server_cores == "all":
        return None
    return parse_cores(opts.server_cores)


def start_server(opts: ServeOptions) -> TritonServer:
    repo = opts.repo_dir or Path(tempfile.mkdtemp(prefix="splitserve-repo-"))
    layout = build_layout(opts)
    if opts.lend_prefill_cores or (
        opts.lend_prefill_cores is None and lending_refusal(layout) is None
    ):
        layout = lend_prefill_cores(layout, str(repo / "core.lock"))
    if layout.device == "gpu":
        check_gpu_layout(layout)
    else:
        prepare_cpu_kernels()
    render(layout, repo)
    server = TritonServer(
        repo,
        http_port=opts.http_port,
        grpc_port=opts.grpc_port,
        metrics_port=opts.metrics_port,
        host=opts.host,
        backend_config={"python": {"thread-pool-size": opts.thread_pool_size}},
        server_cores=server_cores(opts, layout),
    )
    return server.start()


class Companion(Protocol):
    """A service that ``serve_forever`` runs beside tritonserver (the OpenAI frontend)."""

    def shutting_down(self) -> None:
        """The server is about to stop: report not ready from now on."""

    def stop(self) -> None: ...


CompanionFactory = Callable[[TritonServer], Companion]
"""Starts a companion for a server that is up."""


def serve_forever(opts: ServeOptions, companion: CompanionFactory | None = None) -> None:
    """Run until SIGINT/SIGTERM, then stop the server (and its stubs) cleanly.

    ``companion`` starts only once tritonserver is ready, so that nothing of it (a gRPC client
    and its threads) exists in this process while the server is spawned; at shutdown it is told
    first, and stopped last, so that its streams end with the drain's error.
    """
    if opts.repo_dir is None:
        with tempfile.TemporaryDirectory(prefix="splitserve-repo-") as tmp:
            serve_forever(replace(opts, repo_dir=Path(tmp)), companion)
        return
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    layout = build_layout(opts)
    server = start_server(opts)
    models = ", ".join(LAYOUTS[layout.layout])
    source = f", plan {opts.plan}" if opts.plan else ""
    print(f"splitserve: serving {opts.model!r} ({layout.layout}: {models}{source})", flush=True)
    print(f"  HTTP     {server.http_url}  (POST /v2/models/llm/generate_stream)", flush=True)
    print(f"  gRPC     {server.grpc_url}", flush=True)
    print(f"  metrics  {server.metrics_url}", flush=True)
    print(f"  log      {server.log_path}", flush=True)
    running: Companion | None = None
    try:
        running = companion(server) if companion is not None else None
        while not stop.wait(1.0):
            if not server.is_alive():
                raise RuntimeError(f"tritonserver exited:\n{server.log_tail()}")
    finally:
        print("splitserve: shutting down", flush=True)
        if running is not None:
            running.shutting_down()
        server.stop()
        if running is not None:
            running.stop()
