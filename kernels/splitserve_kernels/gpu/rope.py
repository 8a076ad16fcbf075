"""Rotary position embedding (half-split): one program per (token, head)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_st,
    stride_ot,
    stride_oh,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, HALF_PAD)
    mask = d < HALF
    x_row = x_ptr + tok * stride_xt + head * stride_xh
    x1 = tl.load(x_row + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF + d, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + tok * stride_ct + d, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + tok * stride_ct + HALF + d, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + tok * stride_st + d, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + tok * stride_st + HALF + d, mask=mask, other=0.0).to(tl.float32)
    out_row = out_ptr + tok * stride_ot + head * stride_oh
    dtype = out_ptr.dtype.element_ty
    tl.store(out_row + d, (x1 * c1 - x2 * s1).to(dtype), mask=mask)
    tl.store(out_row + HALF + d, (x2 * c2 + x1 * s2).to(dtype), mask=mask)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Same contract as ``reference.rope.apply_rotary``."""
    tokens, heads, dim = x.shape
    if dim % 2 or x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rotary needs an even, contiguous head dim")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _rotary_kernel[(tokens, heads)](
        x,
        cos,
        sin,
        out,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        sin.stride(0),
        out.stride(0),
        out.stride(1),
        HALF=dim // 2,
        HALF_PAD=triton.next_power_of_2(dim // 2),
    )
    return out
