"""The reader process of the two-process cuda_ipc tests (a module, so that spawn can import it)."""

from multiprocessing.connection import Connection

import torch

from splitserve.kv.layout import KVLayout
from splitserve.kv.pool import KVPool
from splitserve.transport.cuda_ipc import CudaIpcTransport


def reader_main(
    conn: Connection, key: bytes, layout: KVLayout, num_blocks: int, device: str
) -> None:
    """Serve ("fetch", handle, ids), ("release", handle) and ("exit",); also owns a pool it
    never closes, to test the cleanup at exit."""
    transport = CudaIpcTransport(key, read_margin_s=0.5)
    pool = KVPool(layout, num_blocks, device)
    pool.tensor.fill_(-1.0)
    transport.register(pool)
    leftover = CudaIpcTransport(key)
    leftover.register(leftover.create_pool(layout, 2, device))
    conn.send(str(leftover.info_path))
    while True:
        cmd, *args = conn.recv()
        if cmd == "exit":
            transport.close()
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
                data = pool.tensor[:, ids].contiguous().view(torch.uint8).cpu().numpy().tobytes()
                conn.send(("ok", data, transport.peer_pools()))
        elif cmd == "release":
            transport.release(args[0])
            conn.send(("ok",))
