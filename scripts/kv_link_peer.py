"""One side of the KV-over-NIXL link benchmark (``bench_link.py`` runs it in a namespace).

    kv_link_peer.py owner HOST BLOCKS   reads "TOKENS" lines, answers each with a handle (hex)
    kv_link_peer.py reader HOST BLOCKS  reads handle lines, fetches + releases each, answers
                                        "seconds bytes" per handle

Both sides use the 100m checkpoint's KV layout in bfloat16 and the key in $SPLITSERVE_HANDLE_KEY.
"""

from __future__ import annotations

import sys
import time

from splitserve.kv.layout import KVLayout
from splitserve.kv.pool import KVPool
from splitserve.transport.key import load_key
from splitserve.transport.nixl import NixlTransport

LAYOUT = KVLayout(num_layers=12, num_kv_heads=4, head_dim=64, block_size=16, dtype="bfloat16")


def owner(host: str, blocks: int) -> None:
    with NixlTransport(load_key(), advertise_host=host, lease_ttl_s=60.0) as transport:
        pool = transport.create_pool(LAYOUT, blocks)
        transport.register(pool)
        pool.tensor.normal_()
        print("ready", flush=True)
        for line in sys.stdin:
            tokens = int(line)
            ids = pool.allocator.allocate(LAYOUT.blocks_for(tokens))
            print(transport.export("bench", ids, tokens).hex(), flush=True)


def reader(host: str, blocks: int) -> None:
    with NixlTransport(load_key(), advertise_host=host, transfer_timeout_s=120.0) as transport:
        pool = KVPool(LAYOUT, blocks)
        transport.register(pool)
        print("ready", flush=True)
        for line in sys.stdin:
            handle = bytes.fromhex(line.strip())
            before = transport.stats()["fetched_bytes"]
            ids = pool.allocator.allocate(len(_ids_of(handle)))
            started = time.perf_counter()
            transport.fetch(handle, ids)
            seconds = time.perf_counter() - started
            transport.release(handle)
            pool.allocator.free(ids)
            print(seconds, transport.stats()["fetched_bytes"] - before, flush=True)


def _ids_of(handle: bytes) -> tuple[int, ...]:
    from splitserve.kv.handle import decode_handle

    return decode_handle(handle, load_key()).block_ids


if __name__ == "__main__":
    role, host, blocks = sys.argv[1], sys.argv[2], int(sys.argv[3])
    (owner if role == "owner" else reader)(host, blocks)
