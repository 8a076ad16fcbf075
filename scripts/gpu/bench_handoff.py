"""Time a cuda_ipc handoff between two processes on one GPU against a plain device-to-device
copy of the same bytes; writes one JSON object (``--out``)."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from multiprocessing.connection import Connection

import torch

from splitserve.kv.layout import KVLayout
from splitserve.kv.pool import KVPool
from splitserve.transport.cuda_ipc import CudaIpcTransport
from splitserve.transport.key import generate_key

LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
"""A Llama-3-8B-shaped block: 2 MiB."""


def _reader(conn: Connection, key: bytes, num_blocks: int, repeats: int) -> None:
    transport = CudaIpcTransport(key, read_margin_s=0.5)
    pool = KVPool(LAYOUT, num_blocks, "cuda:0")
    transport.register(pool)
    ids = list(range(num_blocks))
    fetch_s = []
    for _ in range(repeats + 1):
        handle = conn.recv()
        start = time.perf_counter()
        transport.fetch(handle, ids)
        fetch_s.append(time.perf_counter() - start)
        transport.release(handle)
        conn.send(pool.tensor[:, -1].float().sum().item())
    src = torch.empty_like(pool.tensor)
    copy_s = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        pool.tensor.copy_(src)
        torch.cuda.synchronize()
        copy_s.append(time.perf_counter() - start)
    transport.close()
    conn.send((fetch_s, copy_s))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    key = generate_key()
    owner = CudaIpcTransport(key, lease_ttl_s=60.0)
    pool = owner.create_pool(LAYOUT, args.blocks, "cuda:0")
    owner.register(pool)
    pool.tensor.normal_()
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_reader, args=(child, key, args.blocks, args.repeats))
    proc.start()
    checks = []
    for _ in range(args.repeats + 1):
        while owner.stats().get("outstanding", 0):
            time.sleep(0.001)
        conn.send(owner.export("bench", pool.allocator.allocate(args.blocks), args.blocks * 16))
        checks.append(conn.recv())
    fetch_s, copy_s = conn.recv()
    proc.join(60)
    expected = pool.tensor[:, -1].float().sum().item()
    owner.close()
    nbytes = args.blocks * LAYOUT.block_bytes
    best_fetch, best_copy = min(fetch_s[1:]), min(copy_s)
    result = {
        "bytes": nbytes,
        "first_fetch_ms": fetch_s[0] * 1e3,
        "fetch_ms": best_fetch * 1e3,
        "fetch_gbps": nbytes / best_fetch / 1e9,
        "d2d_copy_ms": best_copy * 1e3,
        "d2d_copy_gbps": nbytes / best_copy / 1e9,
        "fetch_vs_copy": best_copy / best_fetch,
        "data_ok": all(abs(c - expected) <= 1e-3 * max(1.0, abs(expected)) for c in checks),
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
