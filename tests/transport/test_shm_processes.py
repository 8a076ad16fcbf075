"""The shm transport across real processes: this process owns the pool, a spawned one reads."""

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch
from shm_peer import reader_main

from splitserve.kv.handle import decode_handle, encode_handle
from splitserve.kv.layout import KVLayout
from splitserve.transport import cleanup
from splitserve.transport.key import generate_key
from splitserve.transport.shm import ShmTransport

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
KEY = generate_key()


def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


class Peer:
    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=reader_main, args=(child, KEY, LAYOUT, 16))
        self.proc.start()
        self.leftover_segment, self.leftover_address = self.conn.recv()

    def __call__(self, *cmd):
        self.conn.send(cmd)
        assert self.conn.poll(30), "reader process did not answer"
        return self.conn.recv()


@pytest.fixture(scope="module")
def peer():
    p = Peer()
    yield p
    p.conn.send(("exit",))
    p.proc.join(30)
    assert p.proc.exitcode == 0
    assert not os.path.exists(p.leftover_segment), "segment left after exit"
    assert not os.path.exists(p.leftover_address.removeprefix("ipc://")), "socket left after exit"


@pytest.fixture
def owner():
    transport = ShmTransport(KEY, lease_ttl_s=3.0, sweep_interval_s=0.01)
    pool = transport.create_pool(LAYOUT, 12)
    transport.register(pool)
    pool.tensor.copy_(torch.randn(pool.tensor.shape))
    yield transport, pool
    transport.close()


def test_reader_gets_exactly_the_blocks_then_owner_frees_them(peer, owner):
    own, pool = owner
    pool.allocator.allocate(7)
    pool.allocator.free([0, 3])
    src_ids = [5, 1, 2, 6, 4]
    handle = own.export("req-1", src_ids, num_tokens=19)
    status, data = peer("fetch", handle, [11, 3, 4, 0, 9])
    assert status == "ok"
    got = torch.frombuffer(bytearray(data), dtype=torch.float32).view(
        LAYOUT.num_layers, 5, *LAYOUT.slot_shape
    )
    assert torch.equal(got, pool.tensor[:, src_ids])
    wait_for(lambda: own.stats()["pulled"] == 1)
    assert pool.allocator.num_free == 7
    assert peer("release", handle) == ("ok",)
    wait_for(lambda: own.stats()["released"] == 1)
    assert pool.allocator.num_free == 12
    status, kind, message, unchanged = peer("fetch", handle, [11, 3, 4, 0, 9])
    assert (status, kind, unchanged) == ("error", "InvalidHandle", True) and "released" in message
    peer("release", handle)
    wait_for(lambda: own.stats()["unknown"] == 1)
    assert pool.allocator.num_free == 12


def test_lease_never_pulled_expires_in_the_owner(peer, owner):
    own, pool = owner
    own.export("abandoned", pool.allocator.allocate(3), 9)
    wait_for(lambda: own.stats()["expired"] == 1)
    assert pool.allocator.num_free == 12


def test_bad_handles_are_rejected_with_nothing_read(peer, owner):
    own, pool = owner
    handle = own.export("req-2", pool.allocator.allocate(2), 8)
    h = decode_handle(handle, KEY)
    flipped = bytearray(handle)
    flipped[-40] ^= 1
    cases = {
        "MAC": [bytes(flipped), encode_handle(h, generate_key())],
        "expired": [
            encode_handle(replace(h, expiry=time.time() - 1), KEY),
            encode_handle(replace(h, expiry=time.time() + 0.2), KEY),
        ],
        "truncated": [handle[:-1]],
    }
    for match, handles in cases.items():
        for bad in handles:
            status, kind, message, unchanged = peer("fetch", bad, [0, 1])
            assert (status, kind, unchanged) == ("error", "InvalidHandle", True), message
            assert match in message
    assert own.stats()["pulled"] == 0
    assert peer("forge", own.owner_address, h.pool_id, h.lease_id) == ("ok",)
    wait_for(lambda: own.stats()["bad_messages"] == 1)
    assert own.stats()["outstanding"] == 1


_OWNER_SCRIPT = """
import sys, time
from splitserve.kv.layout import KVLayout
from splitserve.transport.shm import ShmTransport
t = ShmTransport(bytes(32))
t.register(t.create_pool(KVLayout(1, 1, 4, 4), 2))
print(t.segment_path, t.owner_address.removeprefix("ipc://"), flush=True)
time.sleep(60)
"""


def test_sigterm_removes_segment_and_socket():
    cmd = [sys.executable, "-c", _OWNER_SCRIPT]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        paths = proc.stdout.readline().split()
        assert len(paths) == 2 and all(os.path.exists(p) for p in paths)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == -signal.SIGTERM
    assert not any(os.path.exists(p) for p in paths)


def test_files_of_a_sigkilled_owner_are_swept_by_the_next_one(tmp_path):
    cmd = [sys.executable, "-c", _OWNER_SCRIPT]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        paths = proc.stdout.readline().split()
        assert all(f"splitserve-{cleanup.pid_namespace()}-{proc.pid}-" in p for p in paths)
        proc.kill()
        proc.wait(30)
    assert all(os.path.exists(p) for p in paths)
    with ShmTransport(bytes(32)) as t:
        t.register(t.create_pool(KVLayout(1, 1, 4, 4), 2))
        assert not any(os.path.exists(p) for p in paths)
    namespace = cleanup.pid_namespace()
    kept = [
        tmp_path / f"splitserve-{namespace}-{os.getpid()}-ab",
        tmp_path / f"splitserve-{namespace + 1}-{proc.pid}-ab",
        tmp_path / "splitserve-cd.sock",
    ]
    dead = tmp_path / f"splitserve-{namespace}-{proc.pid}-ef.sock"
    for path in [*kept, dead]:
        path.touch()
    assert cleanup.sweep_dead_owners(tmp_path) == [dead]
    assert all(path.exists() for path in kept)


def test_forked_child_leaves_the_parents_files_alone(owner):
    own, _ = owner
    pid = os.fork()
    if pid == 0:
        cleanup._at_exit()
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert own.segment_path.exists()
    assert os.path.exists(own.owner_address.removeprefix("ipc://"))
