"""How fast a handoff moves KV compared with a plain torch copy of the same bytes."""

from __future__ import annotations

import time

import torch

from splitserve.kv.layout import KVLayout
from splitserve.kv.pool import KVPool
from splitserve.transport.key import generate_key
from splitserve.transport.shm import ShmTransport


def _wait_released(owner: ShmTransport, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while owner.stats()["outstanding"]:
        if time.monotonic() > deadline:
            raise TimeoutError("the owner did not see the release")
        time.sleep(0.001)


def bench_handoff(
    num_blocks: int, layout: KVLayout, *, repeats: int = 5, scatter: bool = False
) -> dict[str, float]:
    """Export, fetch and release ``num_blocks`` blocks through the shm transport, ``repeats``
    times (best time counts, the first fetch also maps the segment and is reported apart),
    and time ``Tensor.copy_`` of the same bytes. ``scatter`` reverses the destination ids, so
    every block is a copy of its own."""
    key = generate_key()
    with ShmTransport(key) as owner, ShmTransport(key) as reader:
        src = owner.create_pool(layout, num_blocks)
        owner.register(src)
        src.tensor.copy_(torch.randn(src.tensor.shape))
        dst = KVPool(layout, num_blocks)
        reader.register(dst)
        dst_ids = dst.allocator.allocate(num_blocks)
        if scatter:
            dst_ids.reverse()
        fetch_s: list[float] = []
        handle = b""
        for _ in range(repeats + 1):
            src_ids = sorted(src.allocator.allocate(num_blocks))
            handle = owner.export("bench", src_ids, num_blocks * layout.block_size)
            start = time.perf_counter()
            reader.fetch(handle, dst_ids)
            fetch_s.append(time.perf_counter() - start)
            reader.release(handle)
            _wait_released(owner)
        copy_s = []
        for _ in range(repeats):
            start = time.perf_counter()
            dst.tensor.copy_(src.tensor)
            copy_s.append(time.perf_counter() - start)
    nbytes = num_blocks * layout.block_bytes
    best_fetch, best_copy = min(fetch_s[1:]), min(copy_s)
    return {
        "bytes": nbytes,
        "handle_bytes": len(handle),
        "first_fetch_s": fetch_s[0],
        "fetch_s": best_fetch,
        "fetch_gbps": nbytes / best_fetch / 1e9,
        "torch_copy_s": best_copy,
        "torch_copy_gbps": nbytes / best_copy / 1e9,
        "fetch_vs_copy": best_copy / best_fetch,
    }
