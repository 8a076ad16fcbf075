"""The pieces of the NIXL transport below the transport itself: the memory kind of a pool, an
agent whose progress thread waits for UCX's events, the registered fp8 copies of a pool, and the
descriptor tables of blocks laid out like a pool."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from splitserve.kv.layout import KVLayout
from splitserve.kv.pool import KVPool


def mem_of(pool: KVPool) -> tuple[str, int]:
    device = pool.device
    return ("VRAM", device.index or 0) if device.type == "cuda" else ("DRAM", 0)


PROGRESS_TIMEOUT_US = 10_000
"""The longest NIXL's progress thread sleeps without a UCX event (UCX's timers need a turn now
and then); bytes arriving or a socket taking more wake it at once."""


def new_agent(name: str) -> Any:
    """A NIXL agent (UCX backend) whose own progress thread sleeps on the UCX worker's events.

    UCX emulates RMA over TCP: the bytes of a READ or WRITE move only while a thread progresses
    the worker on both ends, the owner of the memory included. NIXL's progress thread does that
    from C++, without the GIL, and waits in ``poll()`` on the worker's event fd in between. The
    Python API fixes that wait's timeout at 0, a busy loop that takes a whole core, so the
    agent's core is built here with ``PROGRESS_TIMEOUT_US``: idle, the thread costs nothing; a
    thread of ours polling from Python every millisecond or two cost a decode step 5-10 % in
    GIL handoffs (BENCHMARKS.md, "Layer-wise KV streaming"). Strict sync: that thread runs
    beside the ones that post transfers."""
    from nixl import _bindings
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    config = _bindings.nixlAgentConfig()
    config.useProgThread = True
    config.useListenThread = False
    config.pthrDelay = PROGRESS_TIMEOUT_US
    config.syncMode = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT.value
    config.captureTelemetry = False
    agent.agent = _bindings.nixlAgent(name, config)
    agent.create_backend("UCX")
    return agent


class Wire:
    """fp8 copies of a pool's blocks (e4m3 bytes, float32 scales per layer, block, K/V and
    head), at the same block ids, registered with the agent."""

    def __init__(self, agent: Any, pool: KVPool) -> None:
        layout = pool.layout
        shape = layout.pool_shape(pool.num_blocks)
        self.q = torch.zeros(shape, dtype=torch.uint8, device=pool.device)
        self.scales = torch.zeros((*shape[:3], layout.num_kv_heads), device=pool.device)
        mem, device_id = mem_of(pool)
        regions = [
            (t.data_ptr(), t.numel() * t.element_size(), device_id, "") for t in self.tensors
        ]
        self._agent = agent
        self._registered = agent.register_memory(regions, mem)

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q, self.scales

    @staticmethod
    def layer_block_bytes(layout: KVLayout) -> tuple[int, int]:
        """Bytes of one layer of one block: e4m3 values, scales."""
        return layout.block_numel // layout.num_layers, 2 * layout.num_kv_heads * 4

    def close(self) -> None:
        self._agent.deregister_memory(self._registered)


def descriptor_table(
    base: int,
    layers: int,
    blocks: int,
    runs: np.ndarray,
    size: int,
    device_id: int,
) -> np.ndarray:
    """NIXL descriptors ``(address, bytes, device)`` of one region laid out like a pool
    (``[layers, blocks, ...]``, ``size`` bytes per layer and block): one per layer and run;
    ``runs`` is ``[n, 2]`` of (first block id on this side, length)."""
    layer = np.arange(layers, dtype=np.uint64)[:, None]
    starts, lengths = runs[:, 0].astype(np.uint64), runs[:, 1].astype(np.uint64)
    addr = np.uint64(base) + (layer * np.uint64(blocks) + starts[None, :]) * np.uint64(size)
    table = np.empty((addr.size, 3), dtype=np.uint64)
    table[:, 0] = addr.reshape(-1)
    table[:, 1] = np.broadcast_to(lengths * np.uint64(size), addr.shape).reshape(-1)
    table[:, 2] = device_id
    return table
