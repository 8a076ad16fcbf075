"""The NIXL transport inside one process: owner and reader are two agents sharing a key, over
UCX's TCP transport on the loopback address."""

import os
import struct
import time
from dataclasses import replace

import pytest
import torch
import zmq

pytest.importorskip("nixl._api", reason="NIXL is not installed (pip install nixl-cu12)")

from nixl_support import LOOPBACK, tcp_only, wait_for  # noqa: F401 (tcp_only: autouse fixture)

from splitserve.kv.handle import InvalidHandle, decode_handle, encode_handle
from splitserve.kv.layout import KVLayout
from splitserve.kv.pool import KVPool
from splitserve.transport import get_transport
from splitserve.transport.key import generate_key
from splitserve.transport.nixl import NixlTransport
from splitserve.transport.nixl_metadata import (
    decode_answer,
    encode_request,
    request_pool,
)

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32")
KEY = generate_key()


@pytest.fixture
def owner():
    transport = NixlTransport(KEY, lease_ttl_s=10.0, read_margin_s=1.0, **LOOPBACK)
    pool = transport.create_pool(LAYOUT, 12)
    transport.register(pool)
    pool.tensor.copy_(torch.arange(pool.tensor.numel(), dtype=torch.float32).view_as(pool.tensor))
    yield transport, pool
    transport.close()


@pytest.fixture
def reader():
    transport = NixlTransport(KEY, read_margin_s=1.0, **LOOPBACK)
    pool = KVPool(LAYOUT, 10)
    pool.tensor.fill_(-1.0)
    transport.register(pool)
    yield transport, pool
    transport.close()


def test_registry_builds_it():
    with get_transport("nixl", key=KEY, advertise_host="127.0.0.1") as transport:
        assert isinstance(transport, NixlTransport)


def test_handle_names_tcp_endpoints(owner):
    own, src = owner
    h = decode_handle(own.export("req", src.allocator.allocate(1), 1), KEY)
    assert h.transport == "nixl"
    assert h.owner.startswith("tcp://127.0.0.1:") and h.peer.startswith("tcp://127.0.0.1:")


def test_fetch_copies_exact_blocks_and_release_frees(owner, reader):
    (own, src), (rd, dst) = owner, reader
    src.allocator.allocate(8)
    src.allocator.free([0, 4, 5])
    handle = own.export("req-1", [1, 2, 3, 6, 7], num_tokens=18)
    rd.fetch(handle, [9, 4, 5, 0, 1])
    assert torch.equal(dst.tensor[:, [9, 4, 5, 0, 1]], src.tensor[:, [1, 2, 3, 6, 7]])
    assert torch.all(dst.tensor[:, [2, 3, 6, 7, 8]] == -1)
    wait_for(lambda: own.stats()["pulled"] == 1)
    rd.release(handle)
    wait_for(lambda: own.stats()["released"] == 1)
    assert src.allocator.num_free == 12
    stats = rd.stats()
    assert stats["peers"] == 1 and stats["fetches"] == 1
    assert stats["fetched_bytes"] == 5 * LAYOUT.block_bytes


def test_metadata_is_fetched_once_per_owner(owner, reader):
    (own, src), (rd, _) = owner, reader
    for i in range(3):
        handle = own.export(f"req-{i}", src.allocator.allocate(2), 8)
        rd.fetch(handle, [2 * i, 2 * i + 1])
        rd.release(handle)
    assert own.stats()["metadata_answered"] == 1
    wait_for(lambda: src.allocator.num_free == 12)


def _rejected(rd, dst, handle, dst_ids, match, error=InvalidHandle):
    with pytest.raises(error, match=match):
        rd.fetch(handle, dst_ids)
    assert torch.all(dst.tensor == -1)


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
    _rejected(rd, dst, encode_handle(replace(h, transport="shm"), KEY), [0, 1], "transport")
    # The first fetch of an owner's pool reads the endpoint; later ones use the cached agent.
    _rejected(rd, dst, encode_handle(replace(h, peer="ipc:///x"), KEY), [0, 1], "endpoint")
    _rejected(rd, dst, encode_handle(replace(h, block_ids=(12, 13)), KEY), [0, 1], "beyond")
    other_pool = replace(h, pool_id=os.urandom(16))
    _rejected(rd, dst, encode_handle(other_pool, KEY), [0, 1], "does not hold")
    _rejected(rd, dst, handle, [0, 10], "range", ValueError)
    assert own.stats()["pulled"] == 0


def test_metadata_needs_the_key(owner):
    own, src = owner
    h = decode_handle(own.export("req", src.allocator.allocate(1), 1), KEY)
    ctx = zmq.Context()
    try:
        with pytest.raises(InvalidHandle, match="does not hold"):
            request_pool(ctx, generate_key(), h.peer, h.pool_id, 2.0)
        sock = ctx.socket(zmq.REQ)
        sock.connect(h.peer)
        sock.send(encode_request(generate_key(), h.pool_id, b"n" * 16))
        assert sock.recv() == b"SSMX"
        sock.close(0)
        good = request_pool(ctx, KEY, h.peer, h.pool_id, 2.0)
        assert good.num_blocks == 12 and good.mem == "DRAM"
        with pytest.raises(InvalidHandle, match="another request"):
            sock = ctx.socket(zmq.REQ)
            sock.connect(h.peer)
            sock.send(encode_request(KEY, h.pool_id, b"a" * 16))
            decode_answer(KEY, sock.recv(), h.pool_id, b"b" * 16)
        sock.close(0)
    finally:
        ctx.term()
    assert own.stats()["metadata_refused"] == 2


def test_unreachable_owner_fails_within_the_metadata_timeout(owner):
    own, src = owner
    h = decode_handle(own.export("req", src.allocator.allocate(1), 1), KEY)
    dead = replace(h, peer="tcp://127.0.0.1:9")
    with NixlTransport(KEY, metadata_timeout_s=0.3, **LOOPBACK) as rd:
        pool = KVPool(LAYOUT, 2)
        rd.register(pool)
        started = time.monotonic()
        with pytest.raises(InvalidHandle, match="did not answer"):
            rd.fetch(encode_handle(dead, KEY), [0])
        assert time.monotonic() - started < 2.0


def new_owner() -> tuple[NixlTransport, KVPool]:
    transport = NixlTransport(KEY, lease_ttl_s=10.0, read_margin_s=1.0, **LOOPBACK)
    pool = transport.create_pool(LAYOUT, 4)
    transport.register(pool)
    return transport, pool


def test_owners_gone_quiet_are_forgotten():
    """A restarted prefill server is a new pool and agent: the reader must not keep the old
    ones (one per restart). An owner unread for ``peer_idle_s`` is forgotten, and asked for its
    metadata again if it comes back (a READ that failed forgets its owner at once:
    test_nixl_processes.py)."""
    with NixlTransport(KEY, read_margin_s=1.0, peer_idle_s=0.2, **LOOPBACK) as rd:
        dst = KVPool(LAYOUT, 4)
        rd.register(dst)
        first, first_pool = new_owner()
        second, second_pool = new_owner()
        try:

            def read(owner: NixlTransport, pool: KVPool, slot: int) -> None:
                handle = owner.export(f"r{slot}", pool.allocator.allocate(1), 1)
                rd.fetch(handle, [slot])
                rd.release(handle)

            read(first, first_pool, 0)
            assert rd.stats()["peers"] == 1
            time.sleep(0.3)
            read(second, second_pool, 1)
            assert rd.stats()["peers"] == 1  # the quiet first owner was forgotten
            read(second, second_pool, 2)
            time.sleep(0.3)
            read(first, first_pool, 3)  # back: its metadata asked again
            assert first.stats()["metadata_answered"] == 2
            assert second.stats()["metadata_answered"] == 1
            assert rd.stats()["peers"] == 1  # and the second, quiet since, forgotten
        finally:
            first.close()
            second.close()


def test_owner_can_fetch_its_own_handles(owner):
    own, src = owner
    ids = src.allocator.allocate(4)
    handle = own.export("colocated", ids[:2], 8)
    own.fetch(handle, ids[2:])
    assert torch.equal(src.tensor[:, ids[2:]], src.tensor[:, ids[:2]])
    own.release(handle)
    assert own.stats()["released"] == 1 and src.allocator.num_free == 10


def test_options_are_checked():
    with pytest.raises(ValueError, match="timeouts"):
        NixlTransport(KEY, transfer_timeout_s=0)
    with NixlTransport(KEY, **LOOPBACK) as t:
        t.create_pool(LAYOUT, 2)
        with pytest.raises(RuntimeError, match="already"):
            t.create_pool(LAYOUT, 2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_transfer_moves_encoded_blocks_and_decodes_them(reader, dtype):
    from splitserve_kernels.reference import fp8

    layout = replace(LAYOUT, dtype=dtype, head_dim=16)
    with NixlTransport(KEY, transfer_dtype="fp8", **LOOPBACK) as own:
        src = own.create_pool(layout, 12)
        own.register(src)
        src.tensor.copy_(torch.randn(src.tensor.shape) * 3)
        with NixlTransport(KEY, **LOOPBACK) as rd:
            dst = KVPool(layout, 10)
            rd.register(dst)
            src.allocator.allocate(8)
            handle = own.export("req", [1, 2, 6, 7], num_tokens=14)
            assert decode_handle(handle, KEY).encoding == "fp8"
            rd.fetch(handle, [3, 4, 0, 9])
            rd.release(handle)
            # What arrives is the reference's encoding of the source, decoded.
            q = torch.zeros(layout.pool_shape(4), dtype=torch.uint8)
            scales = torch.zeros((layout.num_layers, 4, 2, layout.num_kv_heads))
            want = torch.zeros(layout.pool_shape(4), dtype=layout.torch_dtype)
            four = torch.arange(4)
            fp8.encode_blocks(src.tensor, torch.tensor([1, 2, 6, 7]), q, scales, four)
            fp8.decode_blocks(q, scales, four, want, four)
            assert torch.equal(dst.tensor[:, [3, 4, 0, 9]], want)
            per_layer = layout.block_numel // layout.num_layers + 2 * layout.num_kv_heads * 4
            stats = rd.stats()
            assert stats["fetched_bytes"] == stats["fetched_fp8_bytes"] == 4 * 3 * per_layer
            # e4m3 is one byte an element, plus a float32 scale per 4 x 16 values and K/V.
            itemsize = layout.torch_dtype.itemsize
            assert stats["fetched_bytes"] / (4 * layout.block_bytes) == pytest.approx(
                (1 + 4 / 64) / itemsize
            )
            wait_for(lambda: own.stats()["released"] == 1)


def test_fp8_handle_from_an_owner_without_fp8_blocks_is_refused(owner, reader):
    (own, src), (rd, dst) = owner, reader
    h = decode_handle(own.export("req", src.allocator.allocate(2), 8), KEY)
    _rejected(rd, dst, encode_handle(replace(h, encoding="fp8"), KEY), [0, 1], "no fp8 blocks")


def test_unknown_transfer_dtype_is_refused():
    with pytest.raises(ValueError, match="transfer_dtype"):
        NixlTransport(KEY, transfer_dtype="int4", **LOOPBACK)


def test_layers_fetched_one_range_at_a_time_equal_the_whole(owner, reader):
    (own, src), (rd, dst) = owner, reader
    ids = src.allocator.allocate(3)
    handle = own.export("req", ids, num_tokens=10, streamed=True)
    for layers in (range(0, 1), range(1, 3)):
        own.publish_layers(ids, layers)
        rd.fetch_layers(handle, [7, 2, 3], layers)
        assert torch.equal(dst.tensor[layers.start : layers.stop, [7, 2, 3]],
                           src.tensor[layers.start : layers.stop, ids])  # fmt: skip
        assert torch.all(dst.tensor[layers.stop :] == -1)
    stats = rd.stats()
    assert stats["fetches"] == 1 and stats["fetched_layers"] == 3
    assert stats["fetched_bytes"] == 3 * LAYOUT.block_bytes
    with pytest.raises(ValueError, match="layers"):
        rd.fetch_layers(handle, [7, 2, 3], range(2, 4))
    rd.release(handle)
    wait_for(lambda: src.allocator.num_free == 12)


def test_streamed_fp8_layers_are_encoded_as_published(reader):
    layout = replace(LAYOUT, head_dim=16)
    with NixlTransport(KEY, transfer_dtype="fp8", **LOOPBACK) as own:
        src = own.create_pool(layout, 6)
        own.register(src)
        with NixlTransport(KEY, **LOOPBACK) as rd:
            dst = KVPool(layout, 6)
            rd.register(dst)
            ids = src.allocator.allocate(2)
            handle = own.export("req", ids, num_tokens=8, streamed=True)
            whole = own.export("other", src.allocator.allocate(2), num_tokens=8)
            assert decode_handle(handle, KEY).encoding == "fp8"
            # Written after the export: what arrives is what the layer held when published.
            src.tensor.copy_(torch.randn(src.tensor.shape))
            own.publish_layers(ids, range(0, 3))
            rd.fetch_layers(handle, [4, 5], range(0, 3))
            assert torch.allclose(dst.tensor[:, [4, 5]], src.tensor[:, ids], rtol=0.07, atol=1e-3)
            for h in (handle, whole):
                rd.release(h)
            wait_for(lambda: src.allocator.num_free == 6)


def test_fetch_skips_the_blocks_the_reader_has_cached(owner, reader):
    (own, src), (rd, dst) = owner, reader
    src.allocator.allocate(5)
    handle = own.export("req-1", [0, 1, 2, 3], num_tokens=15)
    rd.fetch_layers(handle, [7, 8], range(LAYOUT.num_layers), skip=2)
    assert torch.equal(dst.tensor[:, [7, 8]], src.tensor[:, [2, 3]])
    assert torch.all(dst.tensor[:, :7] == -1)
    assert rd.stats()["fetched_bytes"] == 2 * LAYOUT.block_bytes
    rd.release(handle)
    wait_for(lambda: own.stats()["released"] == 1)
