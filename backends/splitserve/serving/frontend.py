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


def prepare(
    inputs: Mapping[str, np.ndarray],
    tokenizer: Tokenizer,
    max_model_len: int,
    default_max_tokens: int,
) -> Prepared:
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
    return Prepared(gen, ids)
