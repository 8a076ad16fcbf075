"""The runtime's commands: ``serve`` and ``openai`` (the ``splitserve`` entry point in
``splitserve_tools.cli`` adds the client's ``generate`` and the tools' ``bench`` and ``plan``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from splitserve.openai.options import OpenAIOptions, add_frontend_arguments
from splitserve.openai.options import add_arguments as add_openai_arguments

if TYPE_CHECKING:
    from splitserve.deploy.serve import ServeOptions
    from splitserve.openai.server import BackgroundFrontend


def _settings(args: argparse.Namespace) -> dict[str, str]:
    """Engine and serving settings as given: the dedicated flags, then ``--param KEY=VALUE``."""
    settings = {}
    for key in ("dtype", "max_model_len", "block_size", "kv_cache_bytes", "max_num_seqs"):
        value = getattr(args, key)
        if value is not None:
            settings[key] = str(value)
    if getattr(args, "prefix_cache", None) is not None:
        settings["prefix_cache"] = str(args.prefix_cache).lower()
    for item in args.param or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--param expects KEY=VALUE, got {item!r}")
        settings[key.strip()] = value
    return settings


def _frontend_beside(args: argparse.Namespace) -> OpenAIOptions:
    """The OpenAI frontend's settings for ``serve --openai-port``: this server's gRPC port, the
    public model of the layout, the served checkpoint."""
    tiny = args.model == "tiny"
    return OpenAIOptions(
        triton_url=f"localhost:{args.grpc_port}",
        host=args.host,
        port=args.openai_port,
        triton_model="llm_colocated" if args.layout == "colocated" else "llm",
        served_model_name=args.served_model_name or ("tiny" if tiny else None),
        model_dir=None if tiny else Path(args.model),
        max_model_len=args.max_model_len,
        chat_template=args.chat_template,
        log_level=args.openai_log_level,
        stream_idle_timeout=args.stream_idle_timeout,
    )


def _start_frontend(options: OpenAIOptions) -> BackgroundFrontend:
    """``serve --openai-port``: the frontend, started by ``serve_forever`` once Triton is ready,
    so that no gRPC client lives in this process while tritonserver is spawned."""
    # Imported only here: `serve` without --openai-port loads neither FastAPI nor gRPC.
    from splitserve.openai.server import BackgroundFrontend

    frontend = BackgroundFrontend(options).start()
    print(f"  OpenAI   http://{options.host}:{options.port}/v1", flush=True)
    return frontend


PLACEMENT_FLAGS = (
    "layout",
    "device",
    "prefill_instances",
    "decode_instances",
    "colocated_instances",
    "prefill_cores",
    "decode_cores",
    "colocated_cores",
    "prefill_gpus",
    "decode_gpus",
    "colocated_gpus",
)


def serve_options(args: argparse.Namespace) -> ServeOptions:
    """``serve``'s flags; with ``--plan``, placement flags are refused (the plan sets them)."""
    from splitserve.deploy.serve import ServeOptions

    given = {k: getattr(args, k) for k in PLACEMENT_FLAGS if getattr(args, k) is not None}
    if args.plan is not None and given:
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in given)
        raise ValueError(f"--plan sets the placement; drop {flags}")
    return ServeOptions(
        model=args.model,
        settings=_settings(args),
        lend_prefill_cores=args.lend_prefill_cores,
        lend_decode_cores=args.lend_decode_cores,
        server_cores=args.server_cores,
        prefill_max_batch_size=args.prefill_max_batch_size,
        prefill_queue_delay_us=args.prefill_queue_delay_us,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        host=args.host,
        plan=args.plan,
        server_role=args.role,
        prefill_urls=tuple(args.prefill_url or ()),
        prefill_dns=args.prefill_dns,
        transport=args.transport,
        kv_transfer_dtype=args.kv_transfer_dtype,
        kv_stream_layers=args.kv_stream_layers,
        kv_push=args.kv_push,
        key_file=args.key_file,
        advertise_host=args.advertise_host,
        **given,
    )


def cmd_serve(args: argparse.Namespace) -> None:
    """Checks every setting before anything starts: a bad one exits with status 2, naming it."""
    from splitserve.deploy.serve import build_spec, check_paths, serve_forever

    try:
        spec = build_spec(serve_options(args))
        check_paths(spec, args.repo_dir)
    except ValueError as exc:
        args.parser.exit(2, f"splitserve serve: error: {exc}\n")
    if args.openai_port is not None and spec.server_role == "prefill":
        args.parser.exit(2, "splitserve serve: error: --openai-port needs a server with llm\n")
    args.model = spec.model
    args.layout = spec.layout
    args.max_model_len = spec.settings.get("max_model_len")
    if args.openai_port is None:
        serve_forever(spec, args.repo_dir)
        return
    frontend_opts = _frontend_beside(args)
    serve_forever(spec, args.repo_dir, lambda _server: _start_frontend(frontend_opts))


def cmd_openai(args: argparse.Namespace) -> None:
    from splitserve.openai.options import options_from_args
    from splitserve.openai.server import run

    run(options_from_args(args))


def add_split_arguments(s: argparse.ArgumentParser) -> None:
    """Flags of prefill and decode on different servers (docs/multinode.md)."""
    s.add_argument(
        "--role",
        choices=["both", "prefill", "decode"],
        default="both",
        help="both (default): one server runs prefill and decode; prefill: only `prefill`, for "
        "decode servers elsewhere; decode: `llm`, calling the prefill servers below",
    )
    s.add_argument(
        "--prefill-url",
        action="append",
        metavar="HOST:PORT",
        help="gRPC address of a prefill server (--role decode; repeatable)",
    )
    s.add_argument(
        "--prefill-dns",
        metavar="NAME[:PORT]",
        help="DNS name re-resolved every few seconds to the prefill servers, e.g. a Kubernetes "
        "headless Service (--role decode; port default 8001)",
    )
    s.add_argument(
        "--transport",
        choices=["shm", "cuda_ipc", "nixl"],
        help="KV handoff: shm (CPU, one host), cuda_ipc (GPU, one host), nixl (across hosts; "
        "the default of --role prefill/decode)",
    )
    s.add_argument(
        "--kv-transfer-dtype",
        choices=["auto", "fp8"],
        help="nixl: how KV blocks cross the network: auto (the KV cache dtype, default) or fp8 "
        "(e4m3 with a scale per block and head: half of bfloat16's bytes, lossy); set on the "
        "prefill servers",
    )
    s.add_argument(
        "--kv-stream-layers",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--role prefill: answer with the KV handle before the prompt pass and announce each "
        "layer as it is written, so decode servers pull the KV while the pass runs (default with "
        "nixl); --no-kv-stream-layers: the handle after the pass",
    )
    s.add_argument(
        "--kv-push",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--role decode: reserve a prompt's blocks before calling prefill, which WRITEs each "
        "layer into them as its pass writes it and answers once all are in (no per-layer "
        "announcement or pull); --no-kv-push (default): pull prefill's handle",
    )
    s.add_argument(
        "--key-file",
        help="hex handle key (mode 0600) shared by the prefill and decode servers of one "
        "deployment; required with --role prefill/decode",
    )
    s.add_argument(
        "--advertise-host",
        help="the address of this host that peers dial for KV (default: what the host name "
        "resolves to)",
    )


def add_runtime_parsers(sub: argparse._SubParsersAction) -> None:
    """Adds ``serve`` and ``openai`` to a ``splitserve`` parser."""

    s = sub.add_parser("serve", help="render a model repository and run tritonserver on it")
    s.add_argument(
        "--model",
        help="'tiny' (default) or a local Hugging Face checkpoint dir (default of a "
        "--plan: its model)",
    )
    s.add_argument(
        "--plan", type=Path, help="plan.json from `splitserve plan search`: layout and placement"
    )
    s.add_argument("--layout", choices=["disagg", "colocated", "both"], help="default both")
    s.add_argument("--prefill-instances", type=int, help="default 1")
    s.add_argument("--decode-instances", type=int, help="default 1")
    s.add_argument("--colocated-instances", type=int, help="default 1")
    s.add_argument("--prefill-cores", help="core sets per prefill instance, e.g. '0' or '0;1'")
    s.add_argument("--decode-cores")
    s.add_argument("--colocated-cores")
    s.add_argument(
        "--lend-prefill-cores",
        action=argparse.BooleanOptionalAction,
        help="decode also steps on the prefill cores while prefill is idle (CPU, one prefill "
        "and one decode instance; default: wherever the layout allows)",
    )
    s.add_argument(
        "--lend-decode-cores",
        action=argparse.BooleanOptionalAction,
        help="prompt passes also run on the decode cores while decode's steps leave room under "
        "its tpot_target_s (same layouts as --lend-prefill-cores; default: wherever allowed)",
    )
    s.add_argument(
        "--server-cores",
        help="cores for tritonserver's own threads (front ends, backend threads), e.g. '0', or "
        "'all' (default: the prefill cores of a CPU layout with prefill, else all)",
    )
    s.add_argument(
        "--prefill-max-batch-size",
        type=int,
        help="most prompts in one prefill pass (the prefill model's max_batch_size; default 8): "
        "prompts batched together all get their first token when the pass ends",
    )
    s.add_argument(
        "--prefill-queue-delay-us",
        type=int,
        help="how long prefill's dynamic batcher waits to fill a batch, in µs (default 1000)",
    )
    s.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    s.add_argument("--max-model-len", type=int)
    s.add_argument("--block-size", type=int)
    s.add_argument("--kv-cache-bytes", type=int)
    s.add_argument("--max-num-seqs", type=int)
    s.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the KV of prompt prefixes that earlier requests computed (default); "
        "--no-prefix-cache: compute every prompt from its first token",
    )
    s.add_argument("--param", action="append", help="extra model parameter KEY=VALUE")
    s.add_argument("--http-port", type=int, default=8000)
    s.add_argument("--grpc-port", type=int, default=8001)
    s.add_argument(
        "--device",
        choices=["cpu", "gpu"],
        help="cpu (default), or gpu: KIND_GPU instances and the CUDA IPC handoff",
    )
    s.add_argument("--prefill-gpus", help="GPU ids of prefill instances: '0', '0,1', '0-3'")
    s.add_argument("--decode-gpus", help="GPU ids of decode (llm) instances")
    s.add_argument("--colocated-gpus", help="GPU ids of llm_colocated instances (default: all)")
    s.add_argument("--metrics-port", type=int, default=8002)
    s.add_argument("--host", default="0.0.0.0")
    s.add_argument("--repo-dir", type=Path, help="where to render the repository (kept)")
    s.add_argument(
        "--openai-port", type=int, help="also serve the OpenAI-compatible API on this port"
    )
    add_split_arguments(s)
    add_frontend_arguments(s)
    s.set_defaults(func=cmd_serve, parser=s)

    o = sub.add_parser("openai", help="OpenAI-compatible HTTP API in front of a Triton server")
    add_openai_arguments(o)
    o.set_defaults(func=cmd_openai)
