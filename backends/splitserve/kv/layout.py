"""Shape of the paged KV cache, shared by pools, transports and handles.

Layout: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` (block-major).

One block is one contiguous region holding K and V of every layer for ``block_size`` tokens.
The handoff from prefill to decode moves whole blocks, so block-major turns a transfer into one
memcpy per contiguous run of block ids (usually the whole request) instead of ``2 * num_layers``
strided copies; it also lets a lease, a handle and a transport speak in block ids alone.
The price is that per-layer attention reads a strided view of the pool (stride ``num_layers * 2``
pages between blocks), which a gather over the block table absorbs. Layer-by-layer streaming of
KV while prefill still runs is given up: DistServe hands over after the prompt pass anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


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
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_numel(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n

    @property
    def block_bytes(self) -> int:
        return self.block_numel * self.torch_dtype.itemsize

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, *self.block_shape)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
