"""Helpers shared by the benchmark scripts: checkpoints, prompts of exact token length."""

from __future__ import annotations

from pathlib import Path

import torch

from splitserve.model.random_checkpoint import PRESETS, write_random_checkpoint
from splitserve.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

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


def _random_text(tokenizer: Tokenizer, n_tokens: int, gen: torch.Generator) -> str:
    if isinstance(tokenizer, ByteTokenizer):
        return "".join(
            chr(c) for c in torch.randint(97, 123, (n_tokens * 2,), generator=gen).tolist()
        )
    specials = {tokenizer.bos_token_id, *tokenizer.eos_token_ids}
    ids = torch.randint(0, tokenizer.vocab_size, (n_tokens * 2,), generator=gen).tolist()
    return tokenizer.decode([i for i in ids if i not in specials])


def exact_prompts(tokenizer: Tokenizer, count: int, length: int, seed: int = 0) -> list[str]:
    """Texts that encode to exactly ``length`` tokens (BOS included)."""
    gen = torch.Generator().manual_seed(seed)
    prompts: list[str] = []
    while len(prompts) < count:
        text = _random_text(tokenizer, length, gen)
        lo, hi = 0, len(text)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(tokenizer.encode(text[:mid])) <= length:
                lo = mid
            else:
                hi = mid - 1
        if len(tokenizer.encode(text[:lo])) == length:
            prompts.append(text[:lo])
    return prompts
