"""RMSNorm, alone and fused with the residual add before it, in plain torch."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize the last dim in float32, round to ``x``'s dtype, then scale by ``weight``."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual``; returns ``(rms_norm(h), h)``: the next sublayer's input and the
    new residual stream."""
    h = x + residual
    return rms_norm(h, weight, eps), h
