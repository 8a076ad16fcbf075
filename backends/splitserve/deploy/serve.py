"""``splitserve serve``: build the deployment spec, render its repository, start tritonserver,
wait for a signal."""

from __future__ import annotations

import json
import logging
import re
import signal
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from splitserve.deploy.launcher import TritonServer
from splitserve.deploy.render import render
from splitserve.deploy.spec import (
    DeploymentSpec,
    RoleSpec,
    default_cpu_spec,
    default_gpu_spec,
    parse_gpus,
    server_cores,
    setting_from_text,
)
from splitserve.transport.key import HandleKeyError, key_environ, read_key_file

log = logging.getLogger(__name__)
SHELL_SPECIAL = re.compile(r"[\s'\"\\$`!*?&;|<>(){}\[\]#]")


@dataclass(frozen=True)
class ServeOptions:
    """What ``splitserve serve``'s flags say, before ``build_spec`` checks and types it."""

    model: str | None = None
    """A checkpoint directory or ``tiny``; default: the plan's model, else ``tiny``."""
    layout: str | None = None
    """Default: ``both`` on one server, ``disagg`` for a server of one role."""
    settings: dict[str, str] = field(default_factory=dict)
    """Engine and serving settings as the command line spells them (``--param``, ``--dtype``)."""
    prefill_instances: int = 1
    decode_instances: int = 1
    colocated_instances: int = 1
    prefill_cores: str | None = None
    decode_cores: str | None = None
    colocated_cores: str | None = None
    device: str = "cpu"
    prefill_gpus: str | None = None
    """GPU ids (``"0"``, ``"0,1"``, ``"0-3"``); the ``*_instances`` counts are per GPU."""
    decode_gpus: str | None = None
    colocated_gpus: str | None = None
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    host: str = "0.0.0.0"
    thread_pool_size: int = 128
    lend_prefill_cores: bool | None = None
    lend_decode_cores: bool | None = None
    server_cores: str | None = None
    prefill_max_batch_size: int | None = None
    """Most prompts in one prefill pass (Triton's dynamic batcher); None: the spec's."""
    prefill_queue_delay_us: int | None = None
    plan: Path | None = None
    """A ``plan.json`` from ``splitserve plan search``: its deployment sets the layout,
    placement and batching limits; ``model`` and ``settings`` still apply over it."""
    server_role: str = "both"
    prefill_urls: tuple[str, ...] = ()
    prefill_dns: str | None = None
    transport: str | None = None
    kv_transfer_dtype: str | None = None
    kv_stream_layers: bool | None = None
    kv_push: bool | None = None
    key_file: str | None = None
    advertise_host: str | None = None


def typed_settings(raw: dict[str, str]) -> dict[str, Any]:
    return {key: setting_from_text(key, value) for key, value in raw.items()}


def _split_settings(opts: ServeOptions) -> tuple[dict[str, Any], dict[str, Any]]:
    """The settings the role and network flags add: to every role, and to decode only."""
    shared: dict[str, Any] = {}
    if opts.transport is not None:
        shared["transport"] = opts.transport
    if opts.kv_transfer_dtype is not None:
        shared["kv_transfer_dtype"] = opts.kv_transfer_dtype
    if opts.kv_stream_layers is not None:
        shared["kv_stream_layers"] = opts.kv_stream_layers
    if opts.advertise_host is not None:
        shared["advertise_host"] = opts.advertise_host
    decode: dict[str, Any] = {}
    if opts.prefill_urls:
        decode["prefill_urls"] = ",".join(opts.prefill_urls)
    if opts.prefill_dns is not None:
        decode["prefill_dns"] = opts.prefill_dns
    if opts.kv_push is not None:
        decode["kv_push"] = opts.kv_push
    return shared, decode


def _with_split(spec: DeploymentSpec, opts: ServeOptions) -> DeploymentSpec:
    shared, decode = _split_settings(opts)
    return replace(
        spec,
        settings={**spec.settings, **shared},
        decode=replace(spec.decode, settings={**spec.decode.settings, **decode}),
        server_role=opts.server_role,
        key_file=opts.key_file,
    )


def spec_from_plan(opts: ServeOptions) -> DeploymentSpec:
    assert opts.plan is not None
    try:
        data = json.loads(Path(opts.plan).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read the plan {str(opts.plan)!r}: {exc}") from None
    if not isinstance(data, dict) or "deployment" not in data:
        raise ValueError(
            f"{opts.plan} has no deployment: write it again with `splitserve plan search`"
        )
    spec = DeploymentSpec.from_dict(data["deployment"], where=f"{opts.plan}: deployment")
    given = {**({"model": opts.model} if opts.model else {}), **typed_settings(opts.settings)}

    def role(name: str) -> RoleSpec:
        # What the command line sets wins over the plan's per-role limits too.
        spec_role = spec.role(name)
        return replace(spec_role, settings={**spec_role.settings, **given})

    return _with_split(
        replace(
            spec,
            settings={**spec.settings, **given},
            prefill=role("prefill"),
            decode=role("decode"),
            colocated=role("colocated"),
            **_serving_fields(opts),
        ),
        opts,
    )


def _serving_fields(opts: ServeOptions) -> dict[str, Any]:
    batching = {
        name: getattr(opts, name)
        for name in ("prefill_max_batch_size", "prefill_queue_delay_us")
        if getattr(opts, name) is not None
    }
    return {
        **batching,
        "lend_prefill_cores": opts.lend_prefill_cores,
        "lend_decode_cores": opts.lend_decode_cores,
        "server_cores": opts.server_cores,
        "host": opts.host,
        "http_port": opts.http_port,
        "grpc_port": opts.grpc_port,
        "metrics_port": opts.metrics_port,
        "thread_pool_size": opts.thread_pool_size,
    }


def build_spec(opts: ServeOptions) -> DeploymentSpec:
    """The checked deployment spec of ``opts``; ValueError naming what is wrong."""
    if opts.plan is not None:
        return spec_from_plan(opts)
    settings = {"model": opts.model or "tiny", **typed_settings(opts.settings)}
    layout = opts.layout or ("both" if opts.server_role == "both" else "disagg")
    if opts.device == "gpu":
        core_flags = (opts.prefill_cores, opts.decode_cores, opts.colocated_cores)
        if any(flag is not None for flag in core_flags):
            raise ValueError("core sets apply to --device cpu; GPU instances take GPU ids")
        base = default_gpu_spec(
            layout,
            settings,
            parse_gpus(opts.prefill_gpus or "0"),
            parse_gpus(opts.decode_gpus or "0"),
            parse_gpus(opts.colocated_gpus) if opts.colocated_gpus else None,
        )
    elif opts.device == "cpu":
        gpu_flags = (opts.prefill_gpus, opts.decode_gpus, opts.colocated_gpus)
        if any(flag is not None for flag in gpu_flags):
            raise ValueError("GPU ids need --device gpu")
        base = default_cpu_spec(layout, settings)
    else:
        raise ValueError(f"device must be 'cpu' or 'gpu', got {opts.device!r}")

    def role(spec: RoleSpec, instances: int, cores: str | None) -> RoleSpec:
        if cores is None and opts.server_role != "both" and opts.device == "cpu":
            cores = base.colocated.cpu_cores  # a server of one role computes on all its cores
        return replace(
            spec, instances=instances, cpu_cores=spec.cpu_cores if cores is None else cores
        )

    return _with_split(
        replace(
            base,
            prefill=role(base.prefill, opts.prefill_instances, opts.prefill_cores),
            decode=role(base.decode, opts.decode_instances, opts.decode_cores),
            colocated=role(base.colocated, opts.colocated_instances, opts.colocated_cores),
            **_serving_fields(opts),
        ),
        opts,
    )


def check_gpus(spec: DeploymentSpec) -> None:
    """Fail early, with the reason, when the layout's GPUs do not exist or when a decode GPU
    cannot map a prefill GPU's memory (CUDA IPC between two GPUs needs peer access)."""
    import torch

    if not torch.cuda.is_available():
        log.warning("cannot check the GPU layout here: torch sees no CUDA device")
        return
    count = torch.cuda.device_count()
    used = {g for name in ("prefill", "decode", "colocated") for g in spec.role(name).gpus}
    missing = sorted(g for g in used if g >= count)
    if missing:
        raise ValueError(f"GPUs {missing} do not exist here ({count} visible)")
    if "prefill" not in spec.models:
        return
    for decode in spec.decode.gpus:
        for prefill in spec.prefill.gpus:
            if decode != prefill and not torch.cuda.can_device_access_peer(decode, prefill):
                raise ValueError(
                    f"decode GPU {decode} has no peer access to prefill GPU {prefill}, which "
                    "CUDA IPC needs: pick GPUs linked by NVLink or PCIe P2P, or share one GPU"
                )


def prepare_cpu_kernels() -> None:
    """Build the CPU kernels here, once, before the instances start: each would otherwise wait
    on the same build inside the server's start-up timeout."""
    import splitserve_kernels

    log.info("preparing the CPU kernels (compiled on the first start of an install)")
    splitserve_kernels.prepare("cpu")


def check_paths(spec: DeploymentSpec, repo: Path | None) -> None:
    """Refuses paths the Python backend's stubs cannot use: it starts them through an unquoted
    shell command line, and their embedded Python encodes file names as ASCII."""
    where = str(repo.resolve()) if repo is not None else ""
    if SHELL_SPECIAL.search(where) or not where.isascii():
        raise ValueError(
            f"tritonserver cannot run models from {str(repo)!r}: pick an ASCII repository path "
            "without whitespace, quotes, backslashes or other shell metacharacters"
        )
    if not spec.model.isascii():
        raise ValueError(f"the model's stubs cannot open {spec.model!r}: use an ASCII path")
    if spec.key_file is not None:
        server_key(spec)


def server_key(spec: DeploymentSpec) -> dict[str, str]:
    """The environment that hands the deployment's key to the server: the key file's, read
    and checked here (ValueError naming the file if it is missing, unreadable or readable by
    others); empty without a key file (the launcher makes a fresh key)."""
    if spec.key_file is None:
        return {}
    try:
        return key_environ(read_key_file(spec.key_file))
    except HandleKeyError as exc:
        raise ValueError(f"--key-file: {exc}") from None


def start_server(spec: DeploymentSpec, repo_dir: Path | None = None) -> TritonServer:
    """Render ``spec`` into ``repo_dir`` (a new temporary directory by default) and start
    tritonserver on it."""
    repo = repo_dir or Path(tempfile.mkdtemp(prefix="splitserve-repo-"))
    check_paths(spec, repo)
    if spec.device == "gpu":
        check_gpus(spec)
    else:
        prepare_cpu_kernels()
    render(spec, repo)
    server = TritonServer(
        repo,
        http_port=spec.http_port,
        grpc_port=spec.grpc_port,
        metrics_port=spec.metrics_port,
        host=spec.host,
        backend_config={"python": {"thread-pool-size": spec.thread_pool_size}},
        server_cores=server_cores(spec),
        env=server_key(spec),
    )
    return server.start()


class Companion(Protocol):
    """A service that ``serve_forever`` runs beside tritonserver (the OpenAI frontend)."""

    def shutting_down(self) -> None:
        """The server is about to stop: report not ready from now on."""

    def stop(self) -> None: ...


CompanionFactory = Callable[[TritonServer], Companion]
"""Starts a companion for a server that is up."""


def serve_forever(
    spec: DeploymentSpec,
    repo_dir: Path | None = None,
    companion: CompanionFactory | None = None,
) -> None:
    """Run until SIGINT/SIGTERM, then stop the server (and its stubs) cleanly.

    ``companion`` starts only once tritonserver is ready, so that nothing of it (a gRPC client
    and its threads) exists in this process while the server is spawned; at shutdown it is told
    first, and stopped last, so that its streams end with the drain's error.
    """
    if repo_dir is None:
        with tempfile.TemporaryDirectory(prefix="splitserve-repo-") as tmp:
            serve_forever(spec, Path(tmp), companion)
        return
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server = start_server(spec, repo_dir)
    models = ", ".join(spec.models)
    role = "" if spec.server_role == "both" else f", role {spec.server_role}"
    print(f"splitserve: serving {spec.model!r} ({spec.layout}{role}: {models})", flush=True)
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
