"""Greedy decoding's token choice in plain torch."""

from __future__ import annotations

import torch


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest entry of ``logits`` ``[batch, vocab]`` (long ``[batch]``): the
    first where several tie, the first NaN in a row holding one. ``max(dim).indices`` rather than
    ``argmax``: the same answer, faster on CPUs."""
    return torch.max(logits, dim=-1).indices
