"""How a NIXL reader learns an owner's agent: one signed request and answer over ZeroMQ.

NIXL's agent metadata is a pickle that ``add_remote_agent`` loads, so a reader must accept it
only from a process holding the server start's key. The owner answers on ``tcp://<advertised
host>:<ephemeral port>`` (the handle's ``peer``)::

    request  b"SSMQ" | pool id (16) | nonce (16) | HMAC(key, all before)
    answer   b"SSMA" | nonce (16) | pool id (16) | base address (u64) | pool bytes (u64)
             | device id (u32) | memory kind (u8: 1 DRAM, 2 VRAM) | blocks (u32)
             | fp8 wire blocks address (u64) | fp8 scales address (u64) (0, 0: none)
             | agent name length (u16) | agent name | agent metadata | HMAC(key, all before)

The nonce ties an answer to its request (no replay of an old owner's answer); the request's
MAC keeps the metadata from anyone without the key. Anything else gets ``b"SSMX"``.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import struct
import threading
from dataclasses import dataclass

import zmq

from splitserve.kv.handle import ID_SIZE, MAC_SIZE, InvalidHandle, mac
from splitserve.transport.channel import bind_tcp

log = logging.getLogger(__name__)

_REQUEST = struct.Struct("<4s16s16s")
_ANSWER = struct.Struct("<4s16s16sQQIBIQQH")
_MEM_KINDS = {"DRAM": 1, "VRAM": 2}
_MEM_NAMES = {code: name for name, code in _MEM_KINDS.items()}
REFUSED = b"SSMX"


@dataclass(frozen=True)
class PeerPool:
    """What a reader needs to READ from an owner's registered pool."""

    agent_name: str
    base: int
    nbytes: int
    device_id: int
    mem: str
    """``DRAM`` or ``VRAM``."""
    num_blocks: int
    metadata: bytes
    """The agent's NIXL metadata, for ``add_remote_agent`` (only once the MAC matched)."""
    wire_base: int = 0
    """Where the owner's fp8 copies of its blocks lie (``transfer_dtype="fp8"``), else 0."""
    scales_base: int = 0


def encode_request(key: bytes, pool_id: bytes, nonce: bytes) -> bytes:
    body = _REQUEST.pack(b"SSMQ", pool_id, nonce)
    return body + mac(key, body)


def encode_answer(key: bytes, pool_id: bytes, nonce: bytes, pool: PeerPool) -> bytes:
    name = pool.agent_name.encode()
    header = _ANSWER.pack(
        b"SSMA",
        nonce,
        pool_id,
        pool.base,
        pool.nbytes,
        pool.device_id,
        _MEM_KINDS[pool.mem],
        pool.num_blocks,
        pool.wire_base,
        pool.scales_base,
        len(name),
    )
    body = header + name + pool.metadata
    return body + mac(key, body)


def decode_answer(key: bytes, data: bytes, pool_id: bytes, nonce: bytes) -> PeerPool:
    """The owner's pool, or InvalidHandle for a refusal, a bad MAC, another nonce or pool."""
    if data == REFUSED:
        raise InvalidHandle(f"the KV owner does not hold pool {pool_id.hex()} (restarted?)")
    if len(data) < _ANSWER.size + MAC_SIZE:
        raise InvalidHandle("malformed KV owner metadata")
    body, tag = data[:-MAC_SIZE], data[-MAC_SIZE:]
    if not hmac.compare_digest(mac(key, body), tag):
        raise InvalidHandle("KV owner metadata MAC mismatch: not from this deployment's key")
    magic, got_nonce, got_pool, base, nbytes, device, mem, blocks, wire, scales, name_len = (
        _ANSWER.unpack_from(body)
    )
    if magic != b"SSMA" or got_nonce != nonce or got_pool != pool_id or mem not in _MEM_NAMES:
        raise InvalidHandle("KV owner metadata answers another request")
    name_end = _ANSWER.size + name_len
    return PeerPool(
        agent_name=body[_ANSWER.size : name_end].decode(),
        base=base,
        nbytes=nbytes,
        device_id=device,
        mem=_MEM_NAMES[mem],
        num_blocks=blocks,
        metadata=body[name_end:],
        wire_base=wire,
        scales_base=scales,
    )


def request_pool(
    ctx: zmq.Context, key: bytes, endpoint: str, pool_id: bytes, timeout_s: float
) -> PeerPool:
    """Ask the owner at ``endpoint`` for its pool; InvalidHandle if it does not answer in time
    or answers wrongly."""
    nonce = secrets.token_bytes(ID_SIZE)
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    timeout_ms = max(1, round(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    if endpoint.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.connect(endpoint)
        sock.send(encode_request(key, pool_id, nonce))
        data = sock.recv()
    except zmq.Again:
        raise InvalidHandle(
            f"KV owner at {endpoint} did not answer within {timeout_s:g} s (gone or unreachable)"
        ) from None
    finally:
        sock.close()
    return decode_answer(key, data, pool_id, nonce)


class MetadataServer:
    """Owner side: answers signed pool requests on one thread until ``close``."""

    def __init__(
        self, ctx: zmq.Context, key: bytes, host: str, pool_id: bytes, pool: PeerPool
    ) -> None:
        self._key = key
        self._pool_id = pool_id
        self._pool = pool
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.address = bind_tcp(self._sock, host)
        self.counts = dict.fromkeys(("answered", "refused"), 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="splitserve-nixl-md", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            try:
                self._sock.send(self._answer(self._sock.recv()))
            except zmq.ZMQError:
                log.exception("answering a KV metadata request failed")

    def _answer(self, data: bytes) -> bytes:
        body, tag = data[:-MAC_SIZE], data[-MAC_SIZE:]
        ok = (
            len(data) == _REQUEST.size + MAC_SIZE
            and hmac.compare_digest(mac(self._key, body), tag)
            and _REQUEST.unpack(body)[:2] == (b"SSMQ", self._pool_id)
        )
        if not ok:
            self.counts["refused"] += 1
            return REFUSED
        self.counts["answered"] += 1
        nonce = _REQUEST.unpack(body)[2]
        return encode_answer(self._key, self._pool_id, nonce, self._pool)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self._sock.close()
