"""KV pushes over NIXL inside one process: prefill (an owner) WRITEs layers into blocks that decode
(a reader taking pushes) named in a signed target, over UCX's TCP transport on the loopback."""

import time
from dataclasses import replace

import pytest
import torch

pytest.importorskip("nixl._api", reason="NIXL is not installed (pip install nixl-cu12)")

from nixl_support import LOOPBACK, tcp_only, wait_for  # noqa: F401 (tcp_only: autouse fixture)

from splitserve.kv.allocator import BlocksStillWritten
from splitserve.kv.handle import InvalidHandle, decode_handle, encode_handle
from splitserve.kv.layout import KVLayout
from splitserve.kv.pool import KVPool
from splitserve.transport.key import generate_key
from splitserve.transport.nixl import NixlTransport
from splitserve.transport.nixl_push import IncomingPushes, settled_message

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, block_size=4, dtype="float32")
KEY = generate_key()


def _prefill(transfer_dtype: str = "auto", layout: KVLayout = LAYOUT) -> tuple:
    transport = NixlTransport(KEY, transfer_dtype=transfer_dtype, **LOOPBACK)
    pool = transport.create_pool(layout, 12)
    transport.register(pool)
    pool.tensor.copy_(torch.randn(pool.tensor.shape) * 3)
    return transport, pool


def _decode(transfer_dtype: str = "auto", layout: KVLayout = LAYOUT, **options) -> tuple:
    transport = NixlTransport(
        KEY, accept_pushes=True, transfer_dtype=transfer_dtype, **LOOPBACK, **options
    )
    pool = KVPool(layout, 10)
    pool.tensor.fill_(-1.0)
    transport.register(pool)
    return transport, pool


@pytest.fixture
def pair():
    (pre, src), (dec, dst) = _prefill(), _decode()
    yield pre, src, dec, dst
    pre.close()
    dec.close()


def test_layers_pushed_one_at_a_time_land_in_the_targets_blocks(pair):
    pre, src, dec, dst = pair
    target = dec.push_target([5, 6, 1], num_tokens=10)
    key = pre.open_push(target, [2, 3, 7])
    for layer in range(LAYOUT.num_layers):
        pre.push_layers(key, range(layer, layer + 1))
    pre.finish_push(key)
    dec.push_arrived(target)
    assert torch.equal(dst.tensor[:, [5, 6, 1]], src.tensor[:, [2, 3, 7]])
    assert torch.all(dst.tensor[:, [0, 2, 3, 4, 7, 8, 9]] == -1)
    assert dec.stats()["fetched_bytes"] == 3 * LAYOUT.block_bytes
    assert pre.stats()["pushed_bytes"] == 3 * LAYOUT.block_bytes
    assert pre.stats()["pushed_layers"] == LAYOUT.num_layers
    assert dec.stats()["pushes"] == 1


def test_a_target_of_fewer_blocks_takes_the_prompts_last_ones(pair):
    """Decode had the prompt's first blocks cached: the target names only the rest."""
    pre, src, dec, dst = pair
    target = dec.push_target([8, 9], num_tokens=6)
    key = pre.open_push(target, [0, 1, 2, 3])
    pre.push_layers(key, range(0, LAYOUT.num_layers))
    pre.finish_push(key)
    dec.push_arrived(target)
    assert torch.equal(dst.tensor[:, [8, 9]], src.tensor[:, [2, 3]])


def test_bad_targets_are_refused_before_anything_is_written(pair):
    pre, _, dec, dst = pair
    target = dec.push_target([1, 2], num_tokens=8)
    h = decode_handle(target, KEY)
    with pytest.raises(InvalidHandle, match="MAC"):
        pre.open_push(target[:-1] + bytes([target[-1] ^ 1]), [0, 1])
    with pytest.raises(InvalidHandle, match="MAC"):
        pre.open_push(encode_handle(h, generate_key()), [0, 1])
    with pytest.raises(InvalidHandle, match="expired"):
        pre.open_push(encode_handle(replace(h, expiry=time.time() - 1), KEY), [0, 1])
    with pytest.raises(ValueError, match="blocks"):
        pre.open_push(target, [0])
    wider = replace(h, layout=replace(LAYOUT, head_dim=8), lease_id=b"x" * 16)
    with pytest.raises(ValueError, match="layout"):
        pre.open_push(encode_handle(wider, KEY), [0, 1])
    beyond = replace(h, block_ids=(1, 99), lease_id=b"y" * 16)
    with pytest.raises(InvalidHandle, match="beyond"):
        pre.open_push(encode_handle(beyond, KEY), [0, 1])
    pre.open_push(target, [0, 1])
    with pytest.raises(InvalidHandle, match="replayed"):
        pre.open_push(target, [0, 1])
    assert torch.all(dst.tensor == -1)


def test_an_fp8_target_needs_an_fp8_prefill(pair):
    pre, _, _, _ = pair
    dec, _ = _decode("fp8")
    try:
        with pytest.raises(ValueError, match="fp8"):
            pre.open_push(dec.push_target([0], num_tokens=1), [3])
    finally:
        dec.close()


def test_fp8_pushes_travel_encoded_and_are_decoded_on_arrival():
    from splitserve_kernels.reference import fp8

    (pre, src), (dec, dst) = _prefill("fp8"), _decode("fp8")
    try:
        target = dec.push_target([4, 0], num_tokens=7)
        assert decode_handle(target, KEY).encoding == "fp8"
        key = pre.open_push(target, [6, 2])
        for layer in range(LAYOUT.num_layers):
            pre.push_layers(key, range(layer, layer + 1))
        pre.finish_push(key)
        dec.push_arrived(target)
        q = torch.zeros(LAYOUT.pool_shape(2), dtype=torch.uint8)
        scales = torch.zeros((LAYOUT.num_layers, 2, 2, LAYOUT.num_kv_heads))
        want = torch.zeros(LAYOUT.pool_shape(2))
        two = torch.arange(2)
        fp8.encode_blocks(src.tensor, torch.tensor([6, 2]), q, scales, two)
        fp8.decode_blocks(q, scales, two, want, two)
        assert torch.equal(dst.tensor[:, [4, 0]], want)
        stats = dec.stats()
        assert stats["fetched_fp8_bytes"] == stats["fetched_bytes"] < 2 * LAYOUT.block_bytes / 3
    finally:
        pre.close()
        dec.close()


def test_a_failed_pushs_blocks_wait_for_its_settled_notice(pair):
    pre, _, dec, dst = pair
    free = dst.allocator.num_free
    blocks = dst.allocator.allocate(2)
    target = dec.push_target(blocks, num_tokens=8)
    key = pre.open_push(target, [0, 1])
    pre.push_layers(key, range(0, 1))
    # Decode gave up on the call (its client left): the blocks are the push's until it settles.
    held = dec.push_failed(target, "the call was cancelled")
    assert isinstance(held, BlocksStillWritten) and held.block_ids == blocks
    dec.reap_pushes()
    assert dst.allocator.num_free == free - 2
    pre.finish_push(key)  # its WRITEs done: decode hears "settled"
    wait_for(lambda: (dec.reap_pushes(), dst.allocator.num_free)[1] == free)
    assert dec.stats()["push_failures"] == 1


def test_a_failed_pushs_blocks_come_back_after_expiry_without_a_notice():
    pushes = IncomingPushes(transfer_timeout_s=2.0)
    pushes.opened(b"a" * 16, [3, 4])
    assert pushes.failed(b"a" * 16, expiry=100.0) == [3, 4]
    assert pushes.reap(now=102.9) == []
    assert pushes.reap(now=103.1) == [3, 4]
    assert pushes.counts["quarantined_blocks"] == 0


def test_a_settled_notice_before_the_failure_frees_at_once():
    pushes = IncomingPushes(transfer_timeout_s=2.0)
    pushes.opened(b"b" * 16, [1])
    pushes.heard(settled_message(b"b" * 16))
    pushes.heard(b"something else")
    pushes.failed(b"b" * 16, expiry=1e12)
    assert pushes.reap() == [1]


def test_nothing_is_written_after_the_target_expired(pair):
    pre, _, dec, dst = pair
    target = dec.push_target([2], num_tokens=4)
    h = decode_handle(target, KEY)
    short = encode_handle(replace(h, expiry=time.time() + 0.3), KEY)
    key = pre.open_push(short, [5])
    time.sleep(0.4)
    pre.push_layers(key, range(0, LAYOUT.num_layers))
    with pytest.raises(RuntimeError, match="expired"):
        pre.finish_push(key)
    assert torch.all(dst.tensor == -1)
