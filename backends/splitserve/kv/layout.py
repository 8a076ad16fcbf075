"""Shape of the paged KV cache, shared by pools, transports and handles.

Layout: ``[num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]`` (layer-major).

Decode attention reads one layer at a time, so each layer's blocks lie together: a layer is one
contiguous ``[num_blocks, 2, block_size, num_kv_heads, head_dim]`` tensor, consecutive block ids
are adjacent in memory, and a sequence whose blocks were handed out in a run is read as one
stream. (A block-major pool puts one layer's slices of consecutive blocks a whole block apart, a
power-of-two multiple, so they likely share a few cache sets; the CPU decode attention read it
about 1.45x slower with random block ids: BENCHMARKS.md, eighth run.) A handoff moves a run of
block ids as one strided copy over the layers; a lease, a handle and a transport still speak in
block ids alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine_config import DTYPES as DTYPE_NAMES

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}")


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def slot_shape(self) -> tuple[int, ...]:
        """One block of one layer: ``[2, block_size, num_kv_heads, head_dim]``."""
        return (2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_numel(self) -> int:
        """Elements of one block over all layers."""
        n = self.num_layers
        for d in self.slot_shape:
            n *= d
        return n

    @property
    def block_bytes(self) -> int:
        return self.block_numel * self.torch_dtype.itemsize

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, num_blocks, *self.slot_shape)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
