"""Helpers shared by the benchmark scripts: checkpoints, prompts of exact token length."""

from __future__ import annotations

from pathlib import Path

from splitserve.model.random_checkpoint import PRESETS, write_random_checkpoint
from splitserve.tokenizer import Tokenizer, load_tokenizer
from splitserve_client.bench.prompts import exact_prompts

__all__ = ["checkpoint", "exact_prompts", "tokenizer_for"]

CACHE = Path(__file__).resolve().parents[1] / ".cache"


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
