"""Rotary position embedding (half-split convention, as Hugging Face Llama), in plain torch."""

from __future__ import annotations

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` by ``cos``/``sin`` ``[T, 1, head_dim]`` (each
    half of the last dim repeats the same frequencies)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
