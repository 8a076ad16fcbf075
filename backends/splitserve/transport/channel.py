"""Release channel: readers tell an owner which leases they are pulling and which are free.

Readers PUSH (one socket per owner address, cached) to a PULL socket the owner binds at
``ipc://<dir>/splitserve-<pid ns>-<pid>-<random>.sock`` (mode 0600, removed on close; a killed
owner's is swept by the next listener, see ``cleanup``), or, for readers on other hosts, at
``tcp://<host>:<ephemeral port>``. A message is::

    b"SSRM" | kind (u8: 1 pull, 2 release) | pool id (16) | lease id (16) | HMAC-SHA256 (32)

keyed like handles, so only processes of the same server start can free a lease. The owner's
listener thread applies messages to its ``LeaseTable`` and, between them, expires leases.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import struct
import threading
from pathlib import Path

import zmq

from splitserve.kv.handle import MAC_SIZE, mac
from splitserve.kv.lease import LeaseTable
from splitserve.transport import cleanup

log = logging.getLogger(__name__)

PULL = 1
RELEASE = 2
_MESSAGE = struct.Struct("<4sB16s16s")
_MAGIC = b"SSRM"


def encode_message(key: bytes, kind: int, pool_id: bytes, lease_id: bytes) -> bytes:
    body = _MESSAGE.pack(_MAGIC, kind, pool_id, lease_id)
    return body + mac(key, body)


def decode_message(key: bytes, data: bytes) -> tuple[int, bytes, bytes] | None:
    """``(kind, pool_id, lease_id)``, or None for anything malformed or not signed by ``key``."""
    if len(data) != _MESSAGE.size + MAC_SIZE:
        return None
    body, tag = data[: _MESSAGE.size], data[_MESSAGE.size :]
    if not hmac.compare_digest(mac(key, body), tag):
        return None
    magic, kind, pool_id, lease_id = _MESSAGE.unpack(body)
    if magic != _MAGIC or kind not in (PULL, RELEASE):
        return None
    return kind, pool_id, lease_id


def tcp_endpoint(host: str, port: int | str) -> str:
    """``tcp://host:port``, IPv6 hosts in brackets."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def bind_tcp(sock: zmq.Socket, host: str) -> str:
    """Bind ``sock`` to an ephemeral port of ``host``; the address peers dial."""
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.bind(tcp_endpoint(host, "*"))
    except BaseException:
        sock.close()
        raise
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return endpoint.decode()


class ReleaseListener:
    """Owner side: binds the PULL socket and runs one thread that serves it and expires leases."""

    def __init__(
        self,
        ctx: zmq.Context,
        key: bytes,
        pool_id: bytes,
        leases: LeaseTable,
        *,
        socket_dir: str | os.PathLike[str],
        sweep_interval_s: float,
        tcp_host: str | None = None,
    ) -> None:
        """``tcp_host``: listen on that address of this host (an ephemeral port) instead of a
        socket file in ``socket_dir``."""
        self._key = key
        self._pool_id = pool_id
        self._leases = leases
        self._interval_ms = max(1, round(sweep_interval_s * 1000))
        self._sock = ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.path: Path | None = None
        if tcp_host is not None:
            self.address = bind_tcp(self._sock, tcp_host)
        else:
            for stale in cleanup.sweep_dead_owners(socket_dir):
                log.warning("removed %s, left by a process that was killed", stale)
            self.path = Path(socket_dir) / cleanup.owned_name(secrets.token_hex(8), ".sock")
            self.address = f"ipc://{self.path}"
            try:
                self._sock.bind(self.address)
                os.chmod(self.path, 0o600)
            except BaseException:
                self._sock.close()
                self.path.unlink(missing_ok=True)
                raise
        self.counts = dict.fromkeys(("messages", "bad_messages", "foreign", "errors"), 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="splitserve-release", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self._sock.close()
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(self._interval_ms):
                self._drain()
            try:
                self._leases.expire()
            except Exception:
                self.counts["errors"] += 1
                log.exception("expiring KV leases failed")

    def _drain(self) -> None:
        while True:
            try:
                data = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._apply(data)
            except Exception:
                self.counts["errors"] += 1
                log.exception("applying a KV release message failed")

    def _apply(self, data: bytes) -> None:
        self.counts["messages"] += 1
        message = decode_message(self._key, data)
        if message is None:
            self.counts["bad_messages"] += 1
            log.warning("dropped a KV release message with a bad format or MAC")
            return
        kind, pool_id, lease_id = message
        if pool_id != self._pool_id:
            self.counts["foreign"] += 1
        elif kind == PULL:
            self._leases.mark_pulled(lease_id)
        else:
            self._leases.release(lease_id)


class ReleaseSender:
    """Reader side: one cached PUSH socket per owner address; sends never block."""

    def __init__(self, ctx: zmq.Context, key: bytes, *, linger_ms: int = 1000) -> None:
        self._ctx = ctx
        self._key = key
        self._linger_ms = linger_ms
        self._lock = threading.Lock()
        self._sockets: dict[str, zmq.Socket] = {}
        self.dropped = 0

    def send(self, address: str, kind: int, pool_id: bytes, lease_id: bytes) -> bool:
        """Queue one message for ``address``; False if its queue is full (owner gone)."""
        message = encode_message(self._key, kind, pool_id, lease_id)
        with self._lock:
            sock = self._sockets.get(address)
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, self._linger_ms)
                sock.connect(address)
                self._sockets[address] = sock
            try:
                sock.send(message, zmq.NOBLOCK)
                return True
            except zmq.Again:
                self.dropped += 1
                log.warning("KV release queue to %s is full; the lease will expire", address)
                return False

    def close(self) -> None:
        with self._lock:
            for sock in self._sockets.values():
                sock.close()
            self._sockets.clear()
