"""The NIXL transport across real processes: a spawned owner, this process reads over TCP.
A stalled owner (SIGSTOP) makes a transfer miss its deadline: its destination blocks stay held
until it settles; a killed owner's blocks are no longer reachable and its handles fail."""

import multiprocessing
import os
import signal
import time

import pytest
import torch

pytest.importorskip("nixl._api", reason="NIXL is not installed (pip install nixl-cu12)")

from nixl_peer import owner_main

from splitserve.kv.allocator import BlocksStillWritten
from splitserve.kv.handle import InvalidHandle
from splitserve.kv.layout import KVLayout
from splitserve.kv.lease import LockedAllocator
from splitserve.kv.pool import KVPool
from splitserve.transport.key import generate_key
from splitserve.transport.nixl import NixlTransport

# 64 KiB blocks: a 256-block read is 16 MiB, long enough to catch in flight.
LAYOUT = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype="float32")
KEY = generate_key()
BLOCKS = 512


def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class Owner:
    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=owner_main, args=(child, KEY, LAYOUT, BLOCKS))
        self.proc.start()
        assert self.conn.poll(60), "owner process did not start"
        self.pid = self.conn.recv()

    def __call__(self, *cmd):
        self.conn.send(cmd)
        assert self.conn.poll(30), "owner process did not answer"
        return self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            os.kill(self.pid, signal.SIGCONT)
            self.conn.send(("exit",))
            self.proc.join(30)


@pytest.fixture
def owner(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")
    peer = Owner()
    yield peer
    peer.stop()


def reader(timeout_s: float = 10.0) -> tuple[NixlTransport, KVPool]:
    transport = NixlTransport(KEY, advertise_host="127.0.0.1", transfer_timeout_s=timeout_s)
    pool = KVPool(LAYOUT, BLOCKS, allocator=LockedAllocator(BLOCKS))
    transport.register(pool)
    return transport, pool


def expected(ids: list[int]) -> torch.Tensor:
    full = torch.arange(BLOCKS * LAYOUT.block_numel, dtype=torch.float32)
    return full.view(LAYOUT.pool_shape(BLOCKS))[:, ids]


def test_read_across_processes_then_lease_released(owner):
    rd, pool = reader()
    with rd:
        handle = owner("export", 300, 300 * 16)
        dst = pool.allocator.allocate(300)
        rd.fetch(handle, dst)
        src = list(range(300))
        assert torch.equal(pool.tensor[:, dst], expected(src))
        rd.release(handle)
        wait_for(lambda: owner("stats")["free"] == BLOCKS)


def stall_a_read(owner: Owner, rd: NixlTransport, pool: KVPool) -> tuple[bytes, list[int]]:
    """Connect (a one-block warm-up stays used), export 256 blocks, SIGSTOP the owner: the
    READ of the returned handle into the returned blocks cannot finish."""
    warm = owner("export", 1, 1)
    rd.fetch(warm, pool.allocator.allocate(1))
    rd.release(warm)
    handle = owner("export", 256, 256 * 16)
    dst = pool.allocator.allocate(256)
    os.kill(owner.pid, signal.SIGSTOP)
    return handle, dst


def test_stalled_owner_misses_the_deadline_and_blocks_stay_held(owner):
    rd, pool = reader(timeout_s=0.5)
    with rd:
        handle, dst = stall_a_read(owner, rd, pool)
        started = time.monotonic()
        with pytest.raises(BlocksStillWritten) as caught:
            rd.fetch(handle, dst)
        assert time.monotonic() - started < 3.0
        assert caught.value.block_ids == dst
        assert rd.stats()["held_blocks"] == 256 and rd.stats()["transfer_timeouts"] == 1
        rd.release(handle)  # as TransportSource does: what lands is discarded anyway
        os.kill(owner.pid, signal.SIGCONT)
        # The abandoned READ lands once the owner runs again; only then are its blocks free.
        wait_for(lambda: rd.reap() == 0)
        assert rd.stats()["held_blocks"] == 0
        assert pool.allocator.num_free == BLOCKS - 1  # only the warm-up block is still used
        wait_for(lambda: owner("stats")["free"] == BLOCKS)


def test_killed_owner_handles_fail_cleanly(owner):
    rd, pool = reader(timeout_s=2.0)
    with rd:
        handle = owner("export", 8, 100)
        os.kill(owner.pid, signal.SIGKILL)
        owner.proc.join(10)
        dst = pool.allocator.allocate(8)
        with pytest.raises((InvalidHandle, RuntimeError, BlocksStillWritten)):
            rd.fetch(handle, dst)
        wait_for(lambda: rd.reap() == 0)


def test_owner_killed_during_an_abandoned_read_returns_its_blocks(owner):
    rd, pool = reader(timeout_s=0.5)
    with rd:
        handle, dst = stall_a_read(owner, rd, pool)
        with pytest.raises(BlocksStillWritten):
            rd.fetch(handle, dst)
        os.kill(owner.pid, signal.SIGKILL)
        owner.proc.join(10)
        # The failed READ settles (NIXL reports the disconnect) and its blocks come back; the
        # dead owner's remote agent is dropped with it.
        wait_for(lambda: rd.reap() == 0)
        assert pool.allocator.num_free == BLOCKS - 1
        assert rd.stats()["peers"] == 0
