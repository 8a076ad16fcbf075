"""The KV handle: the bytes prefill returns instead of the KV cache itself.

A handle names blocks of one owner's pool and is useless outside the server start that made it:
it ends in an HMAC-SHA256 over every byte before it, keyed with a secret shared only by the
processes of that start. Version 3 layout, little-endian::

    offset  size  field
    0       4     magic b"SSKV"
    4       2     version (u16) = 3
    6       1     dtype code (u8): 1 float32, 2 float16, 3 bfloat16
    7       1     transport name length T (u8)
    8       2     owner address length A (u16)
    10      4     num_layers (u32)
    14      4     num_kv_heads (u32)
    18      4     head_dim (u32)
    22      4     block_size (u32)
    26      4     num_tokens (u32)
    30      4     number of blocks N (u32)
    34      8     expiry, unix time in ns (u64)
    42      16    pool id
    58      16    lease id
    74      2     peer length P (u16)
    76      1     encoding (u8): 0 the pool's dtype, 1 fp8 (e4m3 with per-head block scales)
    77      A     owner address (UTF-8): where releases go
    77+A    T     transport name (ASCII)
    77+A+T  P     peer (UTF-8): what else a reader needs to reach the owner (the metadata
                  endpoint of a networked transport; empty for shm and CUDA IPC)
    ...     4N    block ids (u32 each)
    ...     32    HMAC-SHA256(key, all bytes above)

Decoding checks, in order: length and magic, version, exact total length, MAC, field values,
expiry. Nothing but the fixed header's lengths is interpreted before the MAC matches.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import time
from dataclasses import dataclass
from typing import NamedTuple

from splitserve.kv.layout import KVLayout

MAGIC = b"SSKV"
VERSION = 3
MAC_SIZE = 32
ID_SIZE = 16
MIN_KEY_SIZE = 16

_HEADER = struct.Struct("<4sHBBHIIIIIIQ16s16sHB")
ENCODINGS = ("raw", "fp8")
"""How the blocks travel: ``raw`` in the pool's dtype, ``fp8`` as e4m3 bytes and per-head block
scales (``splitserve_kernels.reference.fp8``) that the reader decodes into its pool."""
_DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3}
_DTYPE_NAMES = {code: name for name, code in _DTYPE_CODES.items()}


class InvalidHandle(ValueError):
    """A KV handle that must not be read: truncated, forged, from another server, or expired."""


@dataclass(frozen=True)
class KVHandle:
    """What a handle says: whose pool, which blocks, how many tokens, until when."""

    owner: str
    pool_id: bytes
    transport: str
    layout: KVLayout
    lease_id: bytes
    block_ids: tuple[int, ...]
    num_tokens: int
    expiry: float
    peer: str = ""
    """Transport-specific way to reach the owner beyond ``owner`` (NIXL: its metadata endpoint)."""
    encoding: str = "raw"
    """One of ``ENCODINGS``."""


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes | bytearray) or len(key) < MIN_KEY_SIZE:
        raise ValueError(f"handle key must be at least {MIN_KEY_SIZE} bytes")


def mac(key: bytes, data: bytes) -> bytes:
    """HMAC-SHA256 of ``data``; shared with the release channel's messages."""
    return hmac.new(key, data, hashlib.sha256).digest()


def encode_handle(handle: KVHandle, key: bytes) -> bytes:
    """Serialize and sign ``handle``; raises ValueError for values the format cannot hold."""
    _check_key(key)
    owner = handle.owner.encode("utf-8")
    name = handle.transport.encode("ascii")
    peer = handle.peer.encode("utf-8")
    layout = handle.layout
    if len(owner) > 0xFFFF or len(name) > 0xFF or len(peer) > 0xFFFF:
        raise ValueError("owner address, transport name or peer too long for a handle")
    if len(handle.pool_id) != ID_SIZE or len(handle.lease_id) != ID_SIZE:
        raise ValueError(f"pool id and lease id must be {ID_SIZE} bytes")
    if handle.encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {handle.encoding!r}")
    try:
        header = _HEADER.pack(
            MAGIC,
            VERSION,
            _DTYPE_CODES[layout.dtype],
            len(name),
            len(owner),
            layout.num_layers,
            layout.num_kv_heads,
            layout.head_dim,
            layout.block_size,
            handle.num_tokens,
            len(handle.block_ids),
            round(handle.expiry * 1e9),
            handle.pool_id,
            handle.lease_id,
            len(peer),
            ENCODINGS.index(handle.encoding),
        )
        ids = struct.pack(f"<{len(handle.block_ids)}I", *handle.block_ids)
    except struct.error as exc:
        raise ValueError(f"handle field out of range: {exc}") from None
    body = header + owner + name + peer + ids
    return body + mac(key, body)


def decode_handle(
    data: bytes,
    key: bytes,
    *,
    now: float | None = None,
    margin_s: float = 0.0,
    check_expiry: bool = True,
) -> KVHandle:
    """Verify and parse a handle; raises InvalidHandle, and nothing else, for any bad input.

    With ``check_expiry``, a handle is rejected unless it is still valid ``margin_s`` seconds
    after ``now`` (default: the current time), so a reader never starts on a lease about to lapse.
    """
    _check_key(key)
    data = bytes(data)
    if data[: len(MAGIC)] != MAGIC[: len(data)]:
        raise InvalidHandle("not a KV handle (bad magic)")
    if len(data) < _HEADER.size:
        raise InvalidHandle(f"KV handle truncated: {len(data)} bytes, header needs {_HEADER.size}")
    header = _Header(*_HEADER.unpack_from(data))
    if header.version != VERSION:
        raise InvalidHandle(
            f"unsupported KV handle version {header.version} (this build reads {VERSION})"
        )
    expected = (
        _HEADER.size
        + header.owner_len
        + header.name_len
        + header.peer_len
        + 4 * header.num_blocks
        + MAC_SIZE
    )
    if len(data) < expected:
        raise InvalidHandle(f"KV handle truncated: {len(data)} bytes of {expected}")
    if len(data) > expected:
        raise InvalidHandle(f"malformed KV handle: {len(data) - expected} trailing bytes")
    body, tag = data[:-MAC_SIZE], data[-MAC_SIZE:]
    if not hmac.compare_digest(mac(key, body), tag):
        raise InvalidHandle("KV handle MAC mismatch: forged, altered, or from another server start")
    handle = _parse(header, body)
    if check_expiry:
        left = handle.expiry - (time.time() if now is None else now)
        if left <= margin_s:
            raise InvalidHandle(
                f"KV handle expired: {left:.3f} s left, reading needs more than {margin_s:.3f} s"
            )
    return handle


class _Header(NamedTuple):
    magic: bytes
    version: int
    dtype_code: int
    name_len: int
    owner_len: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_tokens: int
    num_blocks: int
    expiry_ns: int
    pool_id: bytes
    lease_id: bytes
    peer_len: int
    encoding: int


def _parse(h: _Header, body: bytes) -> KVHandle:
    offset = _HEADER.size
    try:
        owner = body[offset : offset + h.owner_len].decode("utf-8")
        offset += h.owner_len
        name = body[offset : offset + h.name_len].decode("ascii")
        offset += h.name_len
        peer = body[offset : offset + h.peer_len].decode("utf-8")
        offset += h.peer_len
        layout = KVLayout(
            h.num_layers, h.num_kv_heads, h.head_dim, h.block_size, _DTYPE_NAMES[h.dtype_code]
        )
        encoding = ENCODINGS[h.encoding]
    except (UnicodeDecodeError, KeyError, ValueError, IndexError) as exc:
        raise InvalidHandle(f"malformed KV handle: {exc!r}") from None
    if h.num_blocks == 0 or not 0 < h.num_tokens <= h.num_blocks * h.block_size:
        raise InvalidHandle(
            f"malformed KV handle: {h.num_tokens} tokens in {h.num_blocks} blocks of {h.block_size}"
        )
    block_ids = struct.unpack_from(f"<{h.num_blocks}I", body, offset)
    if len(set(block_ids)) != h.num_blocks:
        raise InvalidHandle("malformed KV handle: repeated block ids")
    return KVHandle(
        owner=owner,
        pool_id=h.pool_id,
        transport=name,
        layout=layout,
        lease_id=h.lease_id,
        block_ids=block_ids,
        num_tokens=h.num_tokens,
        expiry=h.expiry_ns / 1e9,
        peer=peer,
        encoding=encoding,
    )
