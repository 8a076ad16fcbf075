"""The ``splitserve`` command: the runtime's ``serve`` and ``openai``, the client's ``generate``,
and the tools' ``bench`` and ``plan``; ``serve`` without placement flags takes the planner's
choice (``serve_choice``)."""

from __future__ import annotations

import argparse
import logging

from splitserve.cli import add_runtime_parsers
from splitserve_client.generate_cli import add_generate_parser
from splitserve_tools.bench.bench_cli import add_bench_parser
from splitserve_tools.plan_cli import add_plan_parsers
from splitserve_tools.serve_choice import add_choice_arguments, choose


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="splitserve", description="Disaggregated LLM serving on Triton"
    )
    sub = ap.add_subparsers(dest="command", required=True)
    add_runtime_parsers(sub)
    add_choice_arguments(sub.choices["serve"])
    add_generate_parser(sub)
    add_bench_parser(sub)
    add_plan_parsers(sub)
    return ap


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parser().parse_args(argv)
    if args.command == "serve":
        choose(args)
    args.func(args)


if __name__ == "__main__":
    main()
