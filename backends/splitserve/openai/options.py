"""Settings of the OpenAI-compatible frontend and their command-line flags."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class OpenAIOptions:
    triton_url: str = "localhost:8001"
    host: str = "0.0.0.0"
    port: int = 9000
    triton_model: str = "llm"
    served_model_name: str | None = None
    model_dir: Path | None = None
    max_model_len: int | None = None
    chat_template: str | None = None
    log_level: str = "warning"
    stream_idle_timeout: float = 60.0
    """Seconds the Triton stream of a request may stay silent before the request fails; 0: no
    limit."""

    @property
    def model_name(self) -> str:
        """The public model name: ``--served-model-name``, else the checkpoint directory's
        name, else the Triton model's."""
        if self.served_model_name:
            return self.served_model_name
        return self.model_dir.name if self.model_dir else self.triton_model


def _seconds(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


def add_frontend_arguments(ap: argparse.ArgumentParser) -> None:
    """Flags shared by ``splitserve openai`` and ``splitserve serve --openai-port``."""
    ap.add_argument("--served-model-name", help="model name clients send (default: the dir name)")
    ap.add_argument(
        "--chat-template", help="Jinja chat template, or a file holding one (overrides the model's)"
    )
    ap.add_argument(
        "--openai-log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (info logs every request)",
    )
    ap.add_argument(
        "--stream-idle-timeout",
        type=_seconds,
        default=OpenAIOptions.stream_idle_timeout,
        metavar="SECONDS",
        help="fail a request (and cancel it in Triton) when its Triton stream sends nothing for "
        "this long, e.g. after a model instance died (default %(default)s; 0: never)",
    )


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--triton-url", default="localhost:8001", help="Triton gRPC address")
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=9000)
    ap.add_argument("--triton-model", default="llm", help="llm or llm_colocated")
    ap.add_argument(
        "--model-dir",
        "--tokenizer",
        dest="model_dir",
        type=Path,
        help="the checkpoint dir (chat template, tokenizer); default: the Triton model's",
    )
    ap.add_argument("--max-model-len", type=int, help="default: the Triton model's")
    add_frontend_arguments(ap)


def options_from_args(args: argparse.Namespace) -> OpenAIOptions:
    return OpenAIOptions(
        triton_url=args.triton_url,
        host=args.host,
        port=args.port,
        triton_model=args.triton_model,
        served_model_name=args.served_model_name,
        model_dir=args.model_dir,
        max_model_len=args.max_model_len,
        chat_template=args.chat_template,
        log_level=args.openai_log_level,
        stream_idle_timeout=args.stream_idle_timeout,
    )
