"""Linear layers with half-precision weights computed in float32, in plain torch; the weight
layout of the CPU kernel (``pack_panels``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

PANEL = 32
"""Output features per panel of a packed weight."""


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` as ``[ceil(N / PANEL), K, PANEL]``: panel ``p`` holds outputs ``p·PANEL`` on,
    each k's ``PANEL`` weights consecutive; outputs past ``N`` are zeros."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // PANEL) * PANEL, k, dtype=weight.dtype, device=weight.device)
    padded[:n] = weight
    return padded.view(-1, PANEL, k).transpose(1, 2).contiguous()


def unpack_panels(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """The ``[N, K]`` weight that ``pack_panels`` packed."""
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:out_features]


def widened_linear(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """``x · wᵀ + bias`` with ``w = unpack_panels(panels)``, every operand widened to float32,
    the result rounded once to ``x``'s dtype."""
    w = unpack_panels(panels, out_features).float()
    b = None if bias is None else bias.float()
    return F.linear(x.float(), w, b).to(x.dtype)
