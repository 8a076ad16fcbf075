"""The owner process of the two-process NIXL tests (a module, so that spawn can import it)."""

import os
from multiprocessing.connection import Connection

import torch

from splitserve.kv.layout import KVLayout
from splitserve.transport.nixl import NixlTransport


def owner_main(conn: Connection, key: bytes, layout: KVLayout, num_blocks: int) -> None:
    """Own a pool filled with its element indices; serve ("export", ids, tokens),
    ("stats",) and ("exit",)."""
    os.environ["UCX_TLS"] = "tcp"
    transport = NixlTransport(key, advertise_host="127.0.0.1", lease_ttl_s=2.0)
    pool = transport.create_pool(layout, num_blocks)
    transport.register(pool)
    pool.tensor.copy_(torch.arange(pool.tensor.numel(), dtype=torch.float32).view_as(pool.tensor))
    conn.send(os.getpid())
    while True:
        cmd, *args = conn.recv()
        if cmd == "exit":
            transport.close()
            return
        if cmd == "export":
            ids = pool.allocator.allocate(args[0])
            conn.send(transport.export("req", ids, args[1]))
        elif cmd == "stats":
            conn.send({**transport.stats(), "free": pool.allocator.num_free})
