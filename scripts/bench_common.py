"""Helpers shared by the benchmark scripts: checkpoints, prompts of exact token length, serve
options on loopback, engine counters off the metrics port."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path
from typing import Any

from splitserve.deploy.serve import ServeOptions, build_spec
from splitserve.deploy.spec import DeploymentSpec
from splitserve.testing.checkpoints import PRESETS, write_random_checkpoint
from splitserve.tokenizer import Tokenizer, load_tokenizer
from splitserve_tools.bench.prompts import exact_prompts

__all__ = ["checkpoint", "counters", "exact_prompts", "loopback", "tokenizer_for"]

CACHE = Path(__file__).resolve().parents[1] / ".cache"
ENGINE_COUNTER = re.compile(
    r'^splitserve_(engine_\w+_total)\{[^}]*model="(\w+)"[^}]*\} (\S+)$', re.M
)


def checkpoint(name: str) -> str:
    """``tiny`` (built in) or a preset written once under ``.cache/`` (e.g. ``100m``)."""
    if name == "tiny":
        return name
    out = CACHE / f"ckpt-{name}"
    if not (out / "config.json").is_file():
        write_random_checkpoint(out, **PRESETS[name], tokenizer="bpe")
    return str(out)


def tokenizer_for(model: str) -> Tokenizer:
    return load_tokenizer(None if model == "tiny" else model)


def loopback(
    model: str, layout: str, base_port: int, settings: dict[str, str], **more: Any
) -> DeploymentSpec:
    """A deployment on 127.0.0.1 as ``splitserve serve`` builds it: HTTP on ``base_port``, gRPC
    on the next, metrics on the one after."""
    opts = ServeOptions(
        model=model,
        layout=layout,
        settings=settings,
        http_port=base_port,
        grpc_port=base_port + 1,
        metrics_port=base_port + 2,
        host="127.0.0.1",
        **more,
    )
    return build_spec(opts)


def counters(metrics_url: str) -> dict[tuple[str, str], float]:
    """The engine counters on a metrics port, by (model, counter name), summed over instances."""
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        text = response.read().decode()
    out: dict[tuple[str, str], float] = {}
    for name, model, value in ENGINE_COUNTER.findall(text):
        out[(model, name)] = out.get((model, name), 0.0) + float(value)
    return out
