"""Linear layers with weights pre-packed once for the CPU's matmul libraries.

For the small row counts of decode (a few to a few dozen tokens), the GEMM libraries re-pack the
weight matrix on every call, which doubles the memory traffic of a memory-bound step. Packing
each weight once removes that:

- float32 goes to MKL (``cblas_sgemm_pack``, exposed by torch as ``mkl._mkl_linear``): measured
  here on 2 cores, a 100M-parameter Llama decode step at batch 8 went from 39 to 24 ms of matmul;
- bfloat16 and float16 go to oneDNN (``mkldnn._linear_pointwise``) on CPUs that multiply them in
  hardware (AMX, AVX512-BF16 / AVX512-FP16): at batch 32 the 100M model's matmuls run about 3.5x
  faster than float32, with results bit-identical to ``F.linear`` in the same dtype;
- on other CPUs oneDNN widens them at a fraction of float32's rate, so they go to
  ``splitserve_kernels.cpu.widened_linear`` (weights in panels, widened to float in registers),
  where the CPU kernels built.

Everything else (GPUs, CPUs without these libraries) uses ``F.linear``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

import splitserve_kernels as kernels
from splitserve_kernels import cpu

PACK_ROWS_HINT = 64
"""Row count the libraries are told to pack for; the packing serves every row count (checked 1
to 2048)."""

_ONEDNN_DTYPES = (torch.bfloat16, torch.float16)
HALF_MATMUL_ENV = "SPLITSERVE_HALF_MATMUL"
"""``onednn`` or ``widened`` overrides the choice for half-precision weights (A/B runs, or a CPU
whose flags mislead)."""


def _mkl_ok(weight: torch.Tensor) -> bool:
    return (
        weight.dtype == torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_linear")
    )


def _onednn_ok(weight: torch.Tensor) -> bool:
    if weight.dtype not in _ONEDNN_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def _panels_ok(weight: torch.Tensor) -> bool:
    return weight.dtype in _ONEDNN_DTYPES and cpu.usable(weight)


@dataclass(frozen=True)
class Packed:
    """A weight in the layout of the library that multiplies it."""

    kind: Literal["mkl", "onednn", "panels"]
    weight: torch.Tensor


def can_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and (
        _mkl_ok(weight) or _onednn_ok(weight) or _panels_ok(weight)
    )


def _half_kind(weight: torch.Tensor) -> Literal["onednn", "panels"]:
    """Where a packable half-precision weight goes: ``$SPLITSERVE_HALF_MATMUL`` (``onednn`` or
    ``widened``) where set and possible, else oneDNN on CPUs that multiply the dtype natively
    and the widening kernel elsewhere."""
    forced = os.environ.get(HALF_MATMUL_ENV, "")
    if forced not in ("", "onednn", "widened"):
        raise ValueError(f"{HALF_MATMUL_ENV} must be onednn or widened, got {forced!r}")
    onednn, panels = _onednn_ok(weight), _panels_ok(weight)
    if not (onednn and panels):
        return "onednn" if onednn else "panels"
    if forced:
        return "onednn" if forced == "onednn" else "panels"
    return "onednn" if cpu.native_matmul(weight.dtype) else "panels"


def pack(weight: torch.Tensor) -> Packed | None:
    """The packed form of a ``[out, in]`` weight, or None where packing does not apply."""
    if not can_pack(weight):
        return None
    w = weight.detach()
    if weight.dtype == torch.float32:
        return Packed("mkl", torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_ROWS_HINT))
    if _half_kind(weight) == "onednn":
        return Packed("onednn", torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT))
    return Packed("panels", kernels.pack_panels(w))


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: Packed | None = None,
) -> torch.Tensor:
    if packed is None:
        return F.linear(x, weight, bias)
    if packed.kind == "panels":
        return cpu.widened_linear(x, packed.weight, bias, weight.shape[0])
    if packed.kind == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, packed.weight, bias, "none", [], "")
    # The last argument must equal the row count, or MKL falls back to the unpacked weight.
    return torch.ops.mkl._mkl_linear(x, packed.weight, weight, bias, x.shape[0])
