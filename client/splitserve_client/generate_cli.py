"""``splitserve generate``: its flags and what it runs."""

from __future__ import annotations

import argparse
import sys


def cmd_generate(args: argparse.Namespace) -> None:
    # Imported here: building the `splitserve` parser loads no gRPC client.
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


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
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
