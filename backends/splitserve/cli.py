"""The runtime's commands: ``serve``, ``generate`` and ``openai`` (the ``splitserve`` entry point
in ``splitserve_tools.cli`` adds ``bench`` and ``plan``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from splitserve.openai.options import OpenAIOptions, add_frontend_arguments
from splitserve.openai.options import add_arguments as add_openai_arguments

if TYPE_CHECKING:
    from splitserve.openai.server import BackgroundFrontend


def _engine_params(args: argparse.Namespace) -> dict[str, str]:
    params = {}
    for key in ("dtype", "max_model_len", "block_size", "kv_cache_bytes", "max_num_seqs"):
        value = getattr(args, key)
        if value is not None:
            params[key] = str(value)
    for item in args.param or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--param expects KEY=VALUE, got {item!r}")
        params[key] = value
    return params


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
SERVE_DEFAULTS = {
    "layout": "both",
    "device": "cpu",
    "prefill_instances": 1,
    "decode_instances": 1,
    "colocated_instances": 1,
}


def _resolve_serve_args(args: argparse.Namespace) -> None:
    """Fill ``serve``'s placement defaults, or take them from ``--plan`` (which then must not
    be contradicted by placement flags)."""
    if args.plan is None:
        args.model = args.model or "tiny"
        for key, value in SERVE_DEFAULTS.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
        return
    from splitserve_tools.planner.plan import Plan

    given = [f"--{k.replace('_', '-')}" for k in PLACEMENT_FLAGS if getattr(args, k) is not None]
    if given:
        raise SystemExit(f"--plan sets the placement; drop {', '.join(given)}")
    plan = Plan.load(args.plan)
    args.model = args.model or plan.model
    args.layout = plan.placement.mode
    args.device = plan.device
    args.max_model_len = args.max_model_len or plan.max_model_len
    for key, value in SERVE_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def cmd_serve(args: argparse.Namespace) -> None:
    from splitserve.deploy.serve import ServeOptions, serve_forever

    _resolve_serve_args(args)
    opts = ServeOptions(
        model=args.model,
        layout=args.layout,
        engine=_engine_params(args),
        prefill_instances=args.prefill_instances,
        decode_instances=args.decode_instances,
        colocated_instances=args.colocated_instances,
        prefill_cores=args.prefill_cores,
        decode_cores=args.decode_cores,
        colocated_cores=args.colocated_cores,
        lend_prefill_cores=args.lend_prefill_cores,
        server_cores=args.server_cores,
        device=args.device,
        prefill_gpus=args.prefill_gpus,
        decode_gpus=args.decode_gpus,
        colocated_gpus=args.colocated_gpus,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        host=args.host,
        repo_dir=args.repo_dir,
        plan=args.plan,
    )
    if args.openai_port is None:
        serve_forever(opts)
        return
    frontend_opts = _frontend_beside(args)
    serve_forever(opts, lambda _server: _start_frontend(frontend_opts))


def cmd_openai(args: argparse.Namespace) -> None:
    from splitserve.openai.options import options_from_args
    from splitserve.openai.server import run

    run(options_from_args(args))


def cmd_generate(args: argparse.Namespace) -> None:
    from splitserve_client.generate import GenerateArgs, generate

    reason = generate(
        GenerateArgs(
            prompt=args.prompt,
            url=args.url,
            model=args.model,
            stream=not args.no_stream,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        )
    )
    print(f"\n[finish_reason={reason}]", file=sys.stderr)


def add_runtime_parsers(sub: argparse._SubParsersAction) -> None:
    """Adds ``serve``, ``openai`` and ``generate`` to a ``splitserve`` parser."""

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
        "--server-cores",
        help="cores for tritonserver's own threads (front ends, backend threads), e.g. '0', or "
        "'all' (default: the prefill cores of a CPU layout with prefill, else all)",
    )
    s.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    s.add_argument("--max-model-len", type=int)
    s.add_argument("--block-size", type=int)
    s.add_argument("--kv-cache-bytes", type=int)
    s.add_argument("--max-num-seqs", type=int)
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
    add_frontend_arguments(s)
    s.set_defaults(func=cmd_serve)

    o = sub.add_parser("openai", help="OpenAI-compatible HTTP API in front of a Triton server")
    add_openai_arguments(o)
    o.set_defaults(func=cmd_openai)

    g = sub.add_parser("generate", help="send one prompt over gRPC and print the text")
    g.add_argument("prompt")
    g.add_argument("--url", default="localhost:8001", help="Triton gRPC address")
    g.add_argument("--model", default="llm", help="llm or llm_colocated")
    g.add_argument("--no-stream", action="store_true", help="one response with the whole text")
    g.add_argument("--stream", action="store_true", help="stream tokens (the default)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--ignore-eos", action="store_true")
    g.set_defaults(func=cmd_generate)
