"""RMSNorm, alone and fused with the residual add before it: one program per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    h_ptr,
    n_cols,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_h,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(h_ptr + row * stride_h + cols, x, mask=mask)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, 0) / n_cols + eps)
    normed = (h * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(x.dtype), mask=mask)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("rms_norm needs a contiguous last dim")
    n = x.shape[-1]
    rows_x = x.reshape(-1, n)
    out = torch.empty_like(rows_x)
    rows_r = residual.reshape(-1, n) if residual is not None else rows_x
    h = torch.empty_like(rows_x) if residual is not None else out
    _rms_norm_kernel[(rows_x.shape[0],)](
        rows_x,
        rows_r,
        weight,
        out,
        h,
        n,
        eps,
        rows_x.stride(0),
        rows_r.stride(0),
        out.stride(0),
        h.stride(0),
        HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(n),
    )
    return out.view(x.shape), (h.view(x.shape) if residual is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as ``reference.norm.rms_norm``."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``reference.norm.add_rms_norm``."""
    out, h = _launch(x, residual, weight, eps)
    assert h is not None
    return out, h
