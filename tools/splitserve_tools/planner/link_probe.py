"""Measure the KV handoff between two hosts over NIXL, the transport split roles use: what
``splitserve plan search --link-json`` prices cross-node placements with.

One host runs ``LinkOwner`` (``splitserve plan link serve``): a NIXL owner with a pool of random
KV and a small ZeroMQ endpoint that answers "N tokens" with a signed handle of N tokens' blocks
and the seconds its export took (fp8 encoding, with ``transfer_dtype="fp8"``). The other runs
``measure`` (``splitserve plan link measure``): for each length it asks for handles, fetches
and releases each one, and keeps the median time of export + fetch (what a request waits for:
prefill's export before its first token, decode's fetch before its second). ``bytes`` is the KV's
size in the pool's dtype, what the planner prices; ``wire_bytes`` what crossed the link. Rows
have the ``rate_gbit``/``tokens``/``bytes``/``seconds`` fields that ``fit.link_fit`` reads, so
the planner learns the link's fixed cost (latency, per-transfer work) and its rate from them
(for fp8 rows, the effective rate of the KV's own bytes).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from splitserve.kv.handle import decode_handle
from splitserve.kv.layout import KVLayout
from splitserve.kv.pool import KVPool
from splitserve.model.hf_config import ModelConfig
from splitserve.transport.channel import bind_tcp, tcp_endpoint
from splitserve.transport.nixl import NixlTransport

LAYOUT = KVLayout(num_layers=12, num_kv_heads=4, head_dim=64, block_size=16, dtype="bfloat16")
"""The 100m checkpoint's KV in bfloat16 (12 KiB per token), unless a model's is given."""
LENGTHS = (128, 1024, 4096)


def model_layout(model_dir: str, dtype: str, block_size: int = 16) -> KVLayout:
    """The KV layout of a checkpoint (its ``config.json`` only) in ``dtype``."""
    cfg = ModelConfig.from_dir(model_dir)
    return KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, dtype)


REQUEST_TIMEOUT_MS = 10_000


class LinkOwner:
    """The serving side: owns a NIXL-registered pool of ``max_tokens`` tokens' blocks and hands
    out leases of them on request, one at a time."""

    def __init__(
        self,
        key: bytes,
        host: str,
        port: int = 0,
        *,
        layout: KVLayout = LAYOUT,
        max_tokens: int = max(LENGTHS),
        transfer_dtype: str = "auto",
    ) -> None:
        self._transport = NixlTransport(
            key, advertise_host=host, lease_ttl_s=60.0, transfer_dtype=transfer_dtype
        )
        self._pool = self._transport.create_pool(layout, layout.blocks_for(max_tokens))
        self._transport.register(self._pool)
        self._pool.tensor.normal_()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        if port:
            self._sock.bind(tcp_endpoint(host, port))
            self.address = tcp_endpoint(host, port)
        else:
            self.address = bind_tcp(self._sock, host)
        self.served = 0

    def serve(self, stop: threading.Event) -> None:
        """Answer requests until ``stop`` is set."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not stop.is_set():
            if poller.poll(100):
                self._sock.send_multipart(self._answer(self._sock.recv()))

    def _answer(self, request: bytes) -> list[bytes]:
        """A handle of the asked-for number of tokens and the seconds its export took, or
        ``error: ...``."""
        try:
            tokens = int(request)
        except ValueError:
            return [b"error: expected a number of tokens"]
        layout = self._pool.layout
        blocks = layout.blocks_for(tokens) if tokens > 0 else 0
        deadline = time.monotonic() + 5.0
        while not self._pool.allocator.can_allocate(blocks) and time.monotonic() < deadline:
            time.sleep(0.001)  # the previous lease's release is on its way
        if tokens <= 0 or not self._pool.allocator.can_allocate(blocks):
            free = self._pool.allocator.num_free * layout.block_size
            return [f"error: cannot lease {tokens} tokens ({free} free)".encode()]
        ids = self._pool.allocator.allocate(blocks)
        self.served += 1
        started = time.perf_counter()
        handle = self._transport.export("link-probe", ids, tokens)
        return [handle, repr(time.perf_counter() - started).encode()]

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()
        self._transport.close()

    def __enter__(self) -> LinkOwner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def measure(
    address: str,
    key: bytes,
    *,
    lengths: Sequence[int] = LENGTHS,
    repeats: int = 7,
    host: str | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Median handoff time of each length from the owner at ``address``; one row per length.
    The first handoff (connection, metadata) is a warm-up and not counted."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, REQUEST_TIMEOUT_MS)
    sock.setsockopt(zmq.SNDTIMEO, REQUEST_TIMEOUT_MS)
    sock.connect(address)

    def ask(tokens: int) -> tuple[bytes, float]:
        sock.send(str(tokens).encode())
        try:
            answer = sock.recv_multipart()
        except zmq.Again:
            raise TimeoutError(f"no answer from the link owner at {address}") from None
        if answer[0].startswith(b"error: "):
            raise RuntimeError(f"link owner: {answer[0][7:].decode()}")
        return answer[0], float(answer[1])

    try:
        first, _ = ask(min(lengths))
        head = decode_handle(first, key)
        layout = head.layout
        with NixlTransport(key, advertise_host=host, transfer_timeout_s=60.0) as reader:
            pool = KVPool(layout, layout.blocks_for(max(lengths)))
            reader.register(pool)

            def handoff(handle: bytes) -> tuple[float, int]:
                """Seconds of one fetch, and the bytes it moved (encoded, for fp8)."""
                ids = pool.allocator.allocate(len(decode_handle(handle, key).block_ids))
                moved = reader.stats()["fetched_bytes"]
                started = time.perf_counter()
                reader.fetch(handle, ids)
                seconds = time.perf_counter() - started
                reader.release(handle)
                pool.allocator.free(ids)
                return seconds, reader.stats()["fetched_bytes"] - moved

            handoff(first)
            rows = []
            for tokens in lengths:
                fetches, exports, wire = [], [], 0
                for _ in range(repeats):
                    handle, export_s = ask(tokens)
                    seconds, wire = handoff(handle)
                    fetches.append(seconds)
                    exports.append(export_s)
                total = statistics.median(f + e for f, e in zip(fetches, exports, strict=True))
                nbytes = layout.blocks_for(tokens) * layout.block_bytes
                row = {
                    "rate_gbit": None,
                    "encoding": head.encoding,
                    "tokens": tokens,
                    "bytes": nbytes,
                    "wire_bytes": wire,
                    "seconds": total,
                    "fetch_seconds": statistics.median(fetches),
                    "export_seconds": statistics.median(exports),
                    "gbit_s": nbytes * 8 / total / 1e9,
                }
                rows.append(row)
                if progress is not None:
                    progress(row)
            return rows
    finally:
        sock.close()
        ctx.term()
