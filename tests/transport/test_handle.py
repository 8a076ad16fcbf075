import hashlib
import hmac
import struct
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.kv.handle import InvalidHandle, KVHandle, decode_handle, encode_handle
from splitserve.kv.layout import KVLayout

KEY = bytes(range(32))
NOW = 1_900_000_000.0
HANDLE = KVHandle(
    owner="ipc:///tmp/splitserve-0123.sock",
    pool_id=b"P" * 16,
    transport="shm",
    layout=KVLayout(4, 2, 16, 8, "bfloat16"),
    lease_id=b"L" * 16,
    block_ids=(5, 6, 7, 2),
    num_tokens=30,
    expiry=NOW + 60,
)


def encode(handle: KVHandle = HANDLE, key: bytes = KEY) -> bytes:
    return encode_handle(handle, key)


def resign(body: bytes, key: bytes = KEY) -> bytes:
    return body + hmac.new(key, body, hashlib.sha256).digest()


def test_round_trip_and_layout():
    data = encode()
    assert data[:4] == b"SSKV" and struct.unpack_from("<H", data, 4) == (3,)
    assert len(data) == 77 + len(HANDLE.owner) + 3 + 4 * 4 + 32
    assert decode_handle(data, KEY, now=NOW) == HANDLE


def test_peer_round_trips():
    with_peer = replace(HANDLE, transport="nixl", peer="tcp://10.0.0.2:41000", encoding="fp8")
    data = encode_handle(with_peer, KEY)
    assert len(data) == 77 + len(HANDLE.owner) + 4 + len(with_peer.peer) + 4 * 4 + 32
    assert data[76] == 1  # fp8
    assert decode_handle(data, KEY, now=NOW) == with_peer


@pytest.mark.parametrize("cut", [0, 3, 5, 40, 75, 76, 120, -1])
def test_truncated(cut):
    data = encode()
    with pytest.raises(InvalidHandle, match=r"truncated|bad magic"):
        decode_handle(data[:cut], KEY, now=NOW)


def test_bad_magic_and_version():
    data = encode()
    with pytest.raises(InvalidHandle, match="bad magic"):
        decode_handle(b"XXXX" + data[4:], KEY, now=NOW)
    with pytest.raises(InvalidHandle, match="version 1"):
        decode_handle(data[:4] + struct.pack("<H", 1) + data[6:], KEY, now=NOW)


def test_modified_forged_and_cross_key():
    data = bytearray(encode())
    data[80] ^= 1
    with pytest.raises(InvalidHandle, match="MAC"):
        decode_handle(bytes(data), KEY, now=NOW)
    with pytest.raises(InvalidHandle, match="MAC"):
        decode_handle(encode(), bytes(32), now=NOW)
    forged = encode(replace(HANDLE, block_ids=(0, 1, 2, 3)), key=b"guessed key 1234")
    with pytest.raises(InvalidHandle, match="MAC"):
        decode_handle(forged, KEY, now=NOW)


def test_trailing_bytes():
    with pytest.raises(InvalidHandle, match="trailing"):
        decode_handle(encode() + b"\0", KEY, now=NOW)


def test_expiry_and_read_margin():
    data = encode()
    assert decode_handle(data, KEY, now=NOW + 58.5, margin_s=1.0) == HANDLE
    with pytest.raises(InvalidHandle, match="expired"):
        decode_handle(data, KEY, now=NOW + 59.5, margin_s=1.0)
    with pytest.raises(InvalidHandle, match="expired"):
        decode_handle(data, KEY, now=NOW + 61)
    assert decode_handle(data, KEY, now=NOW + 61, check_expiry=False) == HANDLE


def _with_header_field(offset: int, fmt: str, value: int) -> bytes:
    body = bytearray(encode()[:-32])
    struct.pack_into(fmt, body, offset, value)
    return resign(bytes(body))


@pytest.mark.parametrize(
    ("offset", "fmt", "value", "match"),
    [
        (6, "<B", 9, "malformed"),  # unknown dtype code
        (10, "<I", 0, "malformed"),  # zero layers
        (26, "<I", 33, "30|33 tokens"),  # more tokens than 4 blocks of 8 hold
        (26, "<I", 0, "malformed"),
        (76, "<B", 2, "malformed"),  # unknown encoding
    ],
)
def test_malformed_fields_with_a_valid_mac(offset, fmt, value, match):
    with pytest.raises(InvalidHandle, match=match):
        decode_handle(_with_header_field(offset, fmt, value), KEY, now=NOW)


def test_malformed_text_and_repeated_blocks():
    body = encode(replace(HANDLE, owner="é" * 4))[:-32]
    bad_owner = resign(body.replace("é".encode(), b"\xff\xfe"))
    with pytest.raises(InvalidHandle, match="malformed"):
        decode_handle(bad_owner, KEY, now=NOW)
    with pytest.raises(InvalidHandle, match="repeated"):
        decode_handle(encode(replace(HANDLE, block_ids=(1, 1, 2, 3))), KEY, now=NOW)


def test_encode_rejects_what_the_format_cannot_hold():
    with pytest.raises(ValueError):
        encode(replace(HANDLE, block_ids=(2**32,)))
    with pytest.raises(ValueError):
        encode(replace(HANDLE, lease_id=b"short"))
    with pytest.raises(ValueError):
        encode(key=b"short")
    with pytest.raises(ValueError, match="encoding"):
        encode(replace(HANDLE, encoding="int4"))


handles = st.builds(
    KVHandle,
    owner=st.text(max_size=40),
    pool_id=st.binary(min_size=16, max_size=16),
    transport=st.sampled_from(["shm", "cuda_ipc", "nixl"]),
    layout=st.builds(
        KVLayout,
        st.integers(1, 128),
        st.integers(1, 64),
        st.integers(1, 256),
        st.integers(1, 64),
        st.sampled_from(["float32", "float16", "bfloat16"]),
    ),
    lease_id=st.binary(min_size=16, max_size=16),
    block_ids=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=20, unique=True).map(tuple),
    num_tokens=st.just(1),
    expiry=st.floats(NOW + 1, NOW + 1e6),
    encoding=st.sampled_from(["raw", "fp8"]),
)


@settings(max_examples=150, deadline=None)
@given(handles)
def test_round_trip_property(handle):
    out = decode_handle(encode_handle(handle, KEY), KEY, now=NOW)
    assert out == replace(handle, expiry=out.expiry)
    assert abs(out.expiry - handle.expiry) < 1e-6


@st.composite
def mutations(draw):
    data = bytearray(encode())
    kind = draw(st.sampled_from(["flip", "truncate", "append", "insert", "delete"]))
    at = draw(st.integers(0, len(data) - 1))
    if kind == "flip":
        data[at] ^= draw(st.integers(1, 255))
    elif kind == "truncate":
        del data[at:]
    elif kind == "append":
        data += draw(st.binary(min_size=1, max_size=64))
    elif kind == "insert":
        data[at:at] = draw(st.binary(min_size=1, max_size=8))
    else:
        del data[at : at + draw(st.integers(1, 8))]
    return bytes(data)


@settings(max_examples=400, deadline=None)
@given(mutations())
def test_any_mutation_is_rejected_cleanly(data):
    with pytest.raises(InvalidHandle):
        decode_handle(data, KEY, now=NOW)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_are_rejected_cleanly(data):
    with pytest.raises(InvalidHandle):
        decode_handle(b"SSKV\x01\x00" + data, KEY, now=NOW)
    with pytest.raises(InvalidHandle):
        decode_handle(data, KEY, now=NOW)
