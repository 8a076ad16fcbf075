"""The shm transport inside one process: owner and reader are two instances sharing a key."""

import os
import stat
import struct
import time
from dataclasses import replace

import pytest
import torch
import zmq

from splitserve.kv.handle import InvalidHandle, decode_handle, encode_handle
from splitserve.kv.layout import KVLayout
from splitserve.kv.pool import KVPool
from splitserve.transport import available_transports, cleanup, get_transport
from splitserve.transport.channel import RELEASE, encode_message
from splitserve.transport.key import generate_key
from splitserve.transport.leased import contiguous_runs
from splitserve.transport.shm import ShmTransport
from splitserve_tools.planner.handoff_timing import bench_handoff

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32")
KEY = generate_key()
FAST = {"sweep_interval_s": 0.01}


def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.fixture
def owner():
    transport = ShmTransport(KEY, lease_ttl_s=10.0, read_margin_s=1.0, **FAST)
    pool = transport.create_pool(LAYOUT, 12)
    transport.register(pool)
    pool.tensor.copy_(torch.arange(pool.tensor.numel(), dtype=torch.float32).view_as(pool.tensor))
    yield transport, pool
    transport.close()


@pytest.fixture
def reader():
    transport = ShmTransport(KEY, read_margin_s=1.0)
    pool = KVPool(LAYOUT, 10)
    pool.tensor.fill_(-1.0)
    transport.register(pool)
    yield transport, pool
    transport.close()


def test_registry():
    assert available_transports() == ["cuda_ipc", "nixl", "shm"]
    with get_transport("shm", key=KEY) as transport:
        assert isinstance(transport, ShmTransport)
    with pytest.raises(ValueError, match="unknown KV transport"):
        get_transport("carrier-pigeon", key=KEY)


def test_contiguous_runs():
    assert contiguous_runs([1, 2, 3, 6, 7], [9, 4, 5, 0, 1]) == [
        (1, 9, 1),
        (2, 4, 2),
        (6, 0, 2),
    ]
    assert contiguous_runs([4, 5, 6], [0, 1, 2]) == [(4, 0, 3)]


def test_fetch_copies_exact_blocks_and_release_frees(owner, reader):
    (own, src), (rd, dst) = owner, reader
    src_ids = src.allocator.allocate(8)
    src.allocator.free([0, 4, 5])
    handle = own.export("req-1", [1, 2, 3, 6, 7], num_tokens=18)
    rd.fetch(handle, [9, 4, 5, 0, 1])
    assert torch.equal(dst.tensor[:, [9, 4, 5, 0, 1]], src.tensor[:, [1, 2, 3, 6, 7]])
    assert torch.all(dst.tensor[:, [2, 3, 6, 7, 8]] == -1)
    assert own.stats()["outstanding"] == 1
    rd.release(handle)
    wait_for(lambda: own.stats()["released"] == 1)
    assert src.allocator.num_free == 12
    assert own.stats()["pulled"] == 1 and len(src_ids) == 8


def test_unpulled_lease_expires_and_frees():
    with ShmTransport(KEY, lease_ttl_s=0.2, read_margin_s=0.05, **FAST) as own:
        pool = own.create_pool(LAYOUT, 4)
        own.register(pool)
        own.export("never-pulled", pool.allocator.allocate(2), 5)
        assert pool.allocator.num_free == 2
        wait_for(lambda: own.stats()["expired"] == 1)
        assert pool.allocator.num_free == 4 and own.stats()["outstanding"] == 0


def _rejected(rd, dst, handle, dst_ids, match, error=InvalidHandle):
    with pytest.raises(error, match=match):
        rd.fetch(handle, dst_ids)
    assert torch.all(dst.tensor == -1)
    assert rd.peer_pools() == 0


def test_bad_handles_are_rejected_before_reading(owner, reader):
    (own, src), (rd, dst) = owner, reader
    handle = own.export("req", src.allocator.allocate(2), 8)
    h = decode_handle(handle, KEY)
    forged = bytearray(handle)
    forged[-40] ^= 0xFF
    _rejected(rd, dst, bytes(forged), [0, 1], "MAC")
    other_blocks = bytearray(handle)
    other_blocks[-32 - 8 : -32] = struct.pack("<2I", 10, 11)
    _rejected(rd, dst, bytes(other_blocks), [0, 1], "MAC")
    _rejected(rd, dst, encode_handle(h, generate_key()), [0, 1], "MAC")
    _rejected(rd, dst, encode_handle(replace(h, expiry=time.time() - 1), KEY), [0, 1], "expired")
    _rejected(rd, dst, encode_handle(replace(h, expiry=time.time() + 0.5), KEY), [0, 1], "expired")
    _rejected(rd, dst, encode_handle(replace(h, transport="nixl"), KEY), [0, 1], "transport")
    _rejected(rd, dst, handle[:50], [0, 1], "truncated")
    _rejected(rd, dst, handle, [0], "distinct", ValueError)
    _rejected(rd, dst, handle, [3, 3], "distinct", ValueError)
    _rejected(rd, dst, handle, [0, 10], "range", ValueError)
    other = replace(h, layout=replace(LAYOUT, head_dim=8))
    _rejected(rd, dst, encode_handle(other, KEY), [0, 1], "layout", ValueError)
    assert own.stats()["pulled"] == 0


def test_replayed_handle_and_release(owner, reader):
    (own, src), (rd, dst) = owner, reader
    handle = own.export("req", src.allocator.allocate(2), 8)
    rd.fetch(handle, [0, 1])
    rd.release(handle)
    wait_for(lambda: own.stats()["released"] == 1)
    dst.tensor.fill_(-1.0)
    with pytest.raises(InvalidHandle, match="released"):
        rd.fetch(handle, [0, 1])
    assert torch.all(dst.tensor == -1)
    rd.release(handle)
    wait_for(lambda: own.stats()["unknown"] == 1)
    assert src.allocator.num_free == 12


def test_forged_and_foreign_release_messages_are_ignored(owner):
    own, src = owner
    h = decode_handle(own.export("req", src.allocator.allocate(3), 9), KEY)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(own.owner_address)
    sock.send(encode_message(generate_key(), RELEASE, h.pool_id, h.lease_id))
    sock.send(encode_message(KEY, RELEASE, b"\0" * 16, h.lease_id))
    sock.send(b"garbage")
    wait_for(lambda: own.stats()["messages"] == 3)
    stats = own.stats()
    assert (stats["bad_messages"], stats["foreign"], stats["outstanding"]) == (2, 1, 1)
    sock.send(encode_message(KEY, RELEASE, h.pool_id, h.lease_id))
    wait_for(lambda: own.stats()["released"] == 1)
    assert src.allocator.num_free == 12
    sock.close(0)
    ctx.term()


def test_owner_can_fetch_and_release_its_own_handles(owner):
    own, src = owner
    ids = src.allocator.allocate(4)
    handle = own.export("colocated", ids[:2], 8)
    own.fetch(handle, ids[2:])
    assert torch.equal(src.tensor[:, ids[2:]], src.tensor[:, ids[:2]])
    own.release(handle)
    assert own.stats()["released"] == 1 and src.allocator.num_free == 10


def test_files_are_private_and_removed_on_close(reader):
    rd, _ = reader
    own = ShmTransport(KEY, **FAST)
    pool = own.create_pool(LAYOUT, 4)
    own.register(pool)
    handle = own.export("req", pool.allocator.allocate(1), 1)
    h = decode_handle(handle, KEY)
    owner = f"splitserve-{cleanup.pid_namespace()}-{os.getpid()}-"
    segment = f"/dev/shm/{owner}{h.pool_id.hex()}"
    assert str(own.segment_path) == segment
    assert os.path.basename(h.owner).startswith(owner)
    socket = h.owner.removeprefix("ipc://")
    for path in (segment, socket):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    rd.fetch(handle, [0])
    own.close()
    own.close()
    assert not os.path.exists(segment) and not os.path.exists(socket)
    with pytest.raises(InvalidHandle, match="gone"):
        rd.fetch(handle, [1])
    assert rd.peer_pools() == 0


def test_export_and_create_pool_misuse(owner, reader):
    (own, src), (rd, _) = owner, reader
    with pytest.raises(RuntimeError, match="create_pool"):
        rd.export("req", [0], 1)
    with pytest.raises(ValueError, match="range"):
        own.export("req", [12], 1)
    with pytest.raises(ValueError, match="fit"):
        own.export("req", [0], 5)
    with pytest.raises(RuntimeError, match="already"):
        own.create_pool(LAYOUT, 2)
    with pytest.raises(RuntimeError, match="already"):
        own.register(src)
    with ShmTransport(KEY) as t, pytest.raises(ValueError, match="CPU"):
        t.create_pool(LAYOUT, 2, "cuda")
    with pytest.raises(ValueError, match="read_margin_s"):
        ShmTransport(KEY, lease_ttl_s=1.0, read_margin_s=1.0)


def test_bench_handoff_reports_rates():
    result = bench_handoff(8, LAYOUT, repeats=2, scatter=True)
    assert result["bytes"] == 8 * LAYOUT.block_bytes
    assert result["fetch_gbps"] > 0 and result["torch_copy_gbps"] > 0


def test_listener_survives_a_failing_free(owner, reader):
    (own, src), (rd, _) = owner, reader
    ids = src.allocator.allocate(2)
    misused = own.export("req", ids, 8)
    src.allocator.free(ids)
    rd.release(misused)
    wait_for(lambda: own.stats()["errors"] == 1)
    handle = own.export("req", src.allocator.allocate(2), 8)
    rd.release(handle)
    wait_for(lambda: own.stats()["released"] == 2)
    assert src.allocator.num_free == 12


def test_release_checks_the_mac_but_not_expiry(owner, reader):
    (own, src), (rd, _) = owner, reader
    h = decode_handle(own.export("req", src.allocator.allocate(1), 1), KEY)
    with pytest.raises(InvalidHandle, match="MAC"):
        rd.release(encode_handle(h, generate_key()))
    rd.release(encode_handle(replace(h, expiry=time.time() - 5), KEY))
    wait_for(lambda: own.stats()["released"] == 1)


def test_layers_fetched_one_range_at_a_time_equal_the_whole(owner, reader):
    (own, src), (rd, dst) = owner, reader
    ids = src.allocator.allocate(2)
    handle = own.export("req", ids, num_tokens=5, streamed=True)
    layers = dst.layout.num_layers
    for layer in range(layers):
        own.publish_layers(ids, range(layer, layer + 1))
        rd.fetch_layers(handle, [3, 1], range(layer, layer + 1))
    assert torch.equal(dst.tensor[:, [3, 1]], src.tensor[:, ids])
    assert rd.stats()["fetched_layers"] == layers and rd.stats()["fetches"] == 1
    rd.release(handle)


def test_fetch_skips_the_blocks_the_reader_has_cached(owner, reader):
    (own, src), (rd, dst) = owner, reader
    src.allocator.allocate(5)
    handle = own.export("req-1", [0, 1, 2, 3], num_tokens=15)
    rd.fetch(handle, [7, 8], skip=2)
    assert torch.equal(dst.tensor[:, [7, 8]], src.tensor[:, [2, 3]])
    assert torch.all(dst.tensor[:, :7] == -1)
    with pytest.raises(ValueError, match="need 1 distinct"):
        rd.fetch(handle, [5, 6], skip=3)
    with pytest.raises(ValueError, match="cannot skip 5"):
        rd.fetch(handle, [], skip=5)
    rd.fetch(handle, [], skip=4)  # every block cached: nothing read
    assert rd.stats()["fetched_bytes"] == 2 * LAYOUT.block_bytes
    rd.release(handle)
    wait_for(lambda: own.stats()["released"] == 1)
