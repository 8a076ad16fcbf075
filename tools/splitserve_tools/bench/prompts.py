"""Prompts that encode to an exact number of tokens with the checkpoint's own tokenizer."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from splitserve.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

PromptMaker = Callable[[int, int], str]
"""``make(length, seed)``: a text that encodes to exactly ``length`` tokens (BOS included)."""


def load_bench_tokenizer(spec: str | None) -> Tokenizer:
    """``tiny`` (or None): the byte tokenizer of the built-in model; else a checkpoint dir."""
    return load_tokenizer(None if spec in (None, "tiny") else spec)


def _random_text(tokenizer: Tokenizer, n_tokens: int, gen: np.random.Generator) -> str:
    if isinstance(tokenizer, ByteTokenizer):
        return "".join(chr(c) for c in gen.integers(97, 123, n_tokens * 2).tolist())
    specials = {tokenizer.bos_token_id, *tokenizer.eos_token_ids}
    ids = gen.integers(0, tokenizer.vocab_size, n_tokens * 2).tolist()
    return tokenizer.decode([i for i in ids if i not in specials])


def _exact(tokenizer: Tokenizer, length: int, gen: np.random.Generator) -> str:
    while True:
        text = _random_text(tokenizer, length, gen)
        lo, hi = 0, len(text)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(tokenizer.encode(text[:mid])) <= length:
                lo = mid
            else:
                hi = mid - 1
        if len(tokenizer.encode(text[:lo])) == length:
            return text[:lo]


def exact_prompts(tokenizer: Tokenizer, count: int, length: int, seed: int = 0) -> list[str]:
    """``count`` texts that encode to exactly ``length`` tokens (BOS included)."""
    gen = np.random.default_rng(seed)
    return [_exact(tokenizer, length, gen) for _ in range(count)]


def prompt_maker(tokenizer: Tokenizer) -> PromptMaker:
    """A ``PromptMaker`` over ``tokenizer``; the same (length, seed) gives the same text."""

    def make(length: int, seed: int) -> str:
        return _exact(tokenizer, length, np.random.default_rng(seed))

    return make
