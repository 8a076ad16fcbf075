"""The reader process of the two-process shm tests (a module, so that spawn can import it)."""

from multiprocessing.connection import Connection

import torch
import zmq

from splitserve.kv.layout import KVLayout
from splitserve.kv.pool import KVPool
from splitserve.transport.channel import RELEASE, encode_message
from splitserve.transport.shm import ShmTransport


def reader_main(conn: Connection, key: bytes, layout: KVLayout, num_blocks: int) -> None:
    """Serve ("fetch", handle, ids), ("release", handle), ("forge", address, pool, lease) and
    ("exit",). It also owns a small pool it never closes, to test cleanup at exit."""
    transport = ShmTransport(key, read_margin_s=0.5)
    pool = KVPool(layout, num_blocks)
    pool.tensor.fill_(-1.0)
    transport.register(pool)
    leftover = ShmTransport(key)
    leftover.register(leftover.create_pool(layout, 2))
    conn.send((str(leftover.segment_path), leftover.owner_address))
    while True:
        cmd, *args = conn.recv()
        if cmd == "exit":
            return
        if cmd == "fetch":
            handle, ids = args
            before = pool.tensor.clone()
            try:
                transport.fetch(handle, ids)
            except Exception as exc:
                unchanged = torch.equal(before, pool.tensor)
                conn.send(("error", type(exc).__name__, str(exc), unchanged))
            else:
                conn.send(
                    ("ok", pool.tensor[:, ids].contiguous().view(torch.uint8).numpy().tobytes())
                )
        elif cmd == "release":
            transport.release(args[0])
            conn.send(("ok",))
        elif cmd == "forge":
            address, pool_id, lease_id = args
            ctx = zmq.Context()
            sock = ctx.socket(zmq.PUSH)
            sock.connect(address)
            sock.send(encode_message(b"not the server key", RELEASE, pool_id, lease_id))
            sock.close(linger=1000)
            ctx.term()
            conn.send(("ok",))
