"""The cuda_ipc transport across real processes: this process owns the pool, a spawned one
reads, on the same GPU and, where there are two, on another one."""

import multiprocessing
import os
import time

import pytest
import torch
from cuda_ipc_peer import reader_main

from splitserve.kv.layout import KVLayout
from splitserve.transport.cuda_ipc import CudaIpcTransport
from splitserve.transport.key import generate_key

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (runs in scripts/gpu_check.sh)"
    ),
]

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")
KEY = generate_key()
READER_DEVICES = [
    "cuda:0",
    pytest.param(
        "cuda:1", marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
    ),
]


def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


class Peer:
    def __init__(self, device: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=reader_main, args=(child, KEY, LAYOUT, 16, device))
        self.proc.start()
        assert self.conn.poll(120), "reader process did not start"
        self.leftover_info = self.conn.recv()

    def __call__(self, *cmd):
        self.conn.send(cmd)
        assert self.conn.poll(60), "reader process did not answer"
        return self.conn.recv()


@pytest.fixture(scope="module", params=READER_DEVICES)
def peer(request):
    p = Peer(request.param)
    yield p
    p.conn.send(("exit",))
    p.proc.join(60)
    assert p.proc.exitcode == 0
    assert not os.path.exists(p.leftover_info), "pool info file left after exit"


@pytest.fixture
def owner():
    transport = CudaIpcTransport(KEY, lease_ttl_s=5.0, sweep_interval_s=0.01)
    pool = transport.create_pool(LAYOUT, 12, "cuda:0")
    transport.register(pool)
    pool.tensor.copy_(torch.randn(pool.tensor.shape, device="cuda:0"))
    yield transport, pool
    transport.close()


def test_reader_gets_exactly_the_blocks_then_owner_frees_them(peer, owner):
    own, pool = owner
    pool.allocator.allocate(7)
    pool.allocator.free([0, 3])
    src_ids = [5, 1, 2, 6, 4]
    handle = own.export("req-1", src_ids, num_tokens=70)
    status, data, peers = peer("fetch", handle, [11, 3, 4, 0, 9])
    assert status == "ok" and peers == 1
    got = torch.frombuffer(bytearray(data), dtype=torch.bfloat16).view(
        LAYOUT.num_layers, 5, *LAYOUT.slot_shape
    )
    assert torch.equal(got, pool.tensor[:, src_ids].cpu())
    wait_for(lambda: own.stats()["pulled"] == 1)
    assert peer("release", handle) == ("ok",)
    wait_for(lambda: own.stats()["released"] == 1)
    assert pool.allocator.num_free == 12
    status, kind, message, unchanged = peer("fetch", handle, [11, 3, 4, 0, 9])
    assert (status, kind, unchanged) == ("error", "InvalidHandle", True) and "released" in message


def test_writes_on_a_side_stream_are_seen_by_the_reader(peer, owner):
    own, pool = owner
    ids = pool.allocator.allocate(4)
    side = torch.cuda.Stream("cuda:0")
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        pool.tensor[:, ids] = 3.0
        handle = own.export("late", ids, 64)
    status, data, _ = peer("fetch", handle, [0, 1, 2, 3])
    assert status == "ok"
    got = torch.frombuffer(bytearray(data), dtype=torch.bfloat16)
    assert torch.all(got == 3.0)
    peer("release", handle)


def test_closed_owner_is_reported_gone(peer):
    own = CudaIpcTransport(KEY)
    pool = own.create_pool(LAYOUT, 4, "cuda:0")
    own.register(pool)
    handle = own.export("req", pool.allocator.allocate(1), 1)
    assert peer("fetch", handle, [5])[0] == "ok"
    peer("release", handle)
    handle = own.export("req", pool.allocator.allocate(1), 1)
    own.close()
    status, kind, message, unchanged = peer("fetch", handle, [6])
    assert (status, kind, unchanged) == ("error", "InvalidHandle", True) and "gone" in message
