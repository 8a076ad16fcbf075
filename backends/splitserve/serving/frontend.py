"""Turns raw request tensors into a validated, tokenized request (shared by llm and colocated)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from splitserve.serving.inputs import GenerateRequest, InputError, parse_generate
from splitserve.tokenizer import Tokenizer


@dataclass(frozen=True)
class Prepared:
    gen: GenerateRequest
    prompt_ids: list[int]
    deadline: float | None
    """``time.monotonic()`` past which the request ends with a timeout error; None: never."""


def prepare(
    inputs: Mapping[str, np.ndarray],
    tokenizer: Tokenizer,
    max_model_len: int,
    default_max_tokens: int,
    default_timeout_s: float | None,
    arrival: float,
) -> Prepared:
    """``default_timeout_s`` limits requests that give no time limit of their own, counted from
    ``arrival`` (``time.monotonic()``)."""
    gen = parse_generate(inputs, default_max_tokens)
    if not gen.prompt:
        raise InputError("input 'text_input' must not be empty")
    ids = tokenizer.encode(gen.prompt)
    if len(ids) >= max_model_len:
        raise InputError(
            f"input 'text_input' has {len(ids)} tokens; the limit is {max_model_len - 1} "
            f"(max_model_len {max_model_len})"
        )
    room = max_model_len - len(ids)
    if gen.params.max_tokens > room:
        raise InputError(
            f"max_tokens {gen.params.max_tokens} plus the prompt's {len(ids)} tokens exceeds "
            f"max_model_len {max_model_len}"
        )
    timeout_s = default_timeout_s if gen.timeout_s is None else gen.timeout_s
    return Prepared(gen, ids, None if timeout_s is None else arrival + timeout_s)
