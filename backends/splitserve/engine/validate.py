"""Checks on what a request asks for, raising ValueError that names the field."""

from __future__ import annotations


def validate_prompt(prompt_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    if not prompt_ids:
        raise ValueError("prompt must not be empty")
    if len(prompt_ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(prompt_ids)} tokens; it must be shorter than max_model_len "
            f"({max_model_len}) to leave room for output"
        )
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size}), got {bad[:5]}")
