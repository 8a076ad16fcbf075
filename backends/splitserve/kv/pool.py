"""The KV block pool: one tensor of ``layout.pool_shape(num_blocks)`` plus its allocator."""

from __future__ import annotations

import torch

from splitserve.kv.allocator import BlockAllocator
from splitserve.kv.layout import KVLayout


class KVPool:
    """Owns the KV tensor and the allocator for its blocks.

    ``storage`` lets a transport place the pool in memory others can open (a ``/dev/shm``
    segment, a CUDA allocation exported over IPC); it must hold exactly the pool's bytes.
    ``allocator`` replaces the default one, e.g. with a thread-safe one for an exported pool.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        device: torch.device | str = "cpu",
        storage: torch.Tensor | None = None,
        allocator: BlockAllocator | None = None,
    ) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        shape = layout.pool_shape(num_blocks)
        if storage is None:
            self.tensor = torch.zeros(shape, dtype=layout.torch_dtype, device=device)
        else:
            if storage.numel() * storage.element_size() != num_blocks * layout.block_bytes:
                raise ValueError("storage size does not match the pool")
            self.tensor = storage.view(layout.torch_dtype).view(shape)
        if allocator is not None and allocator.num_blocks != num_blocks:
            raise ValueError("allocator size does not match the pool")
        self.allocator = allocator if allocator is not None else BlockAllocator(num_blocks)

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """``[num_layers, len(block_ids), 2, block_size, kv_heads, head_dim]`` copy."""
        return self.tensor[:, torch.tensor(block_ids, dtype=torch.long, device=self.device)]

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Inverse of ``read_blocks``."""
        self.tensor[:, torch.tensor(block_ids, dtype=torch.long, device=self.device)] = data.to(
            self.tensor.device, self.tensor.dtype
        )
