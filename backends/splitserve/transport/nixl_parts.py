"""The pieces of the NIXL transport below the transport itself: the memory kind of a pool, the
thread that drives an agent's UCX worker, the registered fp8 copies of a pool, and the
descriptor tables of blocks laid out like a pool."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from splitserve.kv.layout import KVLayout
from splitserve.kv.pool import KVPool

log = logging.getLogger(__name__)


def mem_of(pool: KVPool) -> tuple[str, int]:
    device = pool.device
    return ("VRAM", device.index or 0) if device.type == "cuda" else ("DRAM", 0)


class Progress:
    """Drives the agent's UCX worker, which moves the bytes of RMA over TCP on both ends. An
    owner's: busy (a pause of ``BUSY_S``) for ``BUSY_WINDOW_S`` after each reader's PULL notice
    (its READ follows) while that lease is being read, else every ``IDLE_S``. Bounded, because a
    streamed lease is being read for its whole prompt pass: a busy loop that long takes CPU
    the pass needs. While pushes are under way (``pushing``: sent or expected), every
    ``PUSH_S``: the 4 MiB socket buffers (``nixl.UCX_DEFAULTS``) hold 3 ms of a 10 Gbit/s link, so a
    millisecond keeps it busy at a fraction of the CPU a busy loop takes from the pass beside
    it. Notifications go to ``on_notif``."""

    BUSY_S = 20e-6
    PUSH_S = 1e-3
    IDLE_S = 2e-3
    BUSY_WINDOW_S = 0.005

    def __init__(
        self,
        agent: Any,
        being_read: Callable[[], int],
        pushing: Callable[[], int] = lambda: 0,
        on_notif: Callable[[bytes], None] | None = None,
    ) -> None:
        self._agent = agent
        self._being_read = being_read
        self._pushing = pushing
        self._on_notif = on_notif
        self._busy_until = 0.0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="splitserve-nixl-progress")
        self._thread.daemon = True
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                notifs = self._agent.get_new_notifs()
            except Exception:  # a peer's failure surfaces here too; the reader handles it
                log.debug("NIXL progress reported an error", exc_info=True)
                notifs = {}
            if self._on_notif is not None:
                for messages in notifs.values():
                    for message in messages:
                        self._on_notif(bytes(message))
            if self._wake.is_set():
                self._wake.clear()
                self._busy_until = time.monotonic() + self.BUSY_WINDOW_S
            if self._being_read() and time.monotonic() < self._busy_until:
                time.sleep(self.BUSY_S)
            elif self._pushing():
                time.sleep(self.PUSH_S)
            else:
                self._wake.wait(self.IDLE_S)

    def wake(self) -> None:
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join()


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
