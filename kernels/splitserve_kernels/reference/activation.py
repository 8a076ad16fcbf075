"""SwiGLU's activation in plain torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, written into ``gate`` (silu rounded to the dtype, then the product)."""
    return F.silu(gate, inplace=True).mul_(up)
