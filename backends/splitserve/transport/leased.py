"""What every KV transport shares: handle signing and checks, leases, the release channel.

Subclasses place the owner's pool in memory peers can reach and copy a handle's blocks in
(``_copy_in``); ``MappedTransport`` does the copy for transports that map a peer's pool as a
tensor (shm, CUDA IPC): one strided copy (over the layers) per contiguous run of block ids.
"""

from __future__ import annotations

import tempfile
import threading
import time
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

import torch
import zmq

from splitserve.kv.handle import MIN_KEY_SIZE, InvalidHandle, KVHandle, decode_handle, encode_handle
from splitserve.kv.lease import LeaseTable
from splitserve.kv.pool import KVPool
from splitserve.transport import cleanup
from splitserve.transport.base import KVTransport
from splitserve.transport.channel import PULL, RELEASE, ReleaseListener, ReleaseSender


def contiguous_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` runs where both id lists ascend by one together."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def copy_blocks(
    src: torch.Tensor, src_ids: Sequence[int], dst: torch.Tensor, dst_ids: Sequence[int]
) -> None:
    for s, d, n in contiguous_runs(src_ids, dst_ids):
        dst[:, d : d + n].copy_(src[:, s : s + n])


class LeasedTransport(KVTransport):
    """Base of the concrete transports: everything but memory placement and the copy."""

    def __init__(
        self,
        key: bytes,
        *,
        lease_ttl_s: float = 30.0,
        read_margin_s: float = 1.0,
        pull_ttl_s: float = 60.0,
        sweep_interval_s: float = 0.05,
        socket_dir: str | None = None,
    ) -> None:
        if len(key) < MIN_KEY_SIZE:
            raise ValueError(f"handle key must be at least {MIN_KEY_SIZE} bytes")
        if not 0 <= read_margin_s < lease_ttl_s:
            raise ValueError("need 0 <= read_margin_s < lease_ttl_s")
        self._key = bytes(key)
        self._lease_ttl_s = lease_ttl_s
        self._read_margin_s = read_margin_s
        self._pull_ttl_s = pull_ttl_s
        self._sweep_interval_s = sweep_interval_s
        self._socket_dir = Path(socket_dir or tempfile.gettempdir())
        self._ctx = zmq.Context()
        self._sender = ReleaseSender(self._ctx, self._key)
        self._pool: KVPool | None = None
        self._pool_id: bytes | None = None
        self._leases: LeaseTable | None = None
        self._listener: ReleaseListener | None = None
        self._released: OrderedDict[bytes, float] = OrderedDict()
        self._released_lock = threading.Lock()
        self._closed = False
        self._fetch_counts = dict.fromkeys(
            ("fetches", "fetched_layers", "fetched_bytes", "fetched_fp8_bytes", "fetch_ns"), 0
        )
        cleanup.close_at_exit(self)

    @abstractmethod
    def _exported_pool_id(self, pool: KVPool) -> bytes | None:
        """The pool id peers open ``pool`` by, or None if ``pool`` is not in openable memory."""

    @abstractmethod
    def _copy_in(self, handle: KVHandle, dst_block_ids: list[int], layers: range) -> int:
        """Copy ``layers`` of the checked handle's blocks into ``dst_block_ids`` of the
        registered pool and return the bytes moved (the encoded size where the handle's
        ``encoding`` is not raw); raises InvalidHandle (nothing read) if the owner's pool cannot
        be reached or does not match the handle. Sends the owner the PULL notice first."""

    @abstractmethod
    def _close_memory(self) -> None:
        """Unlink or free the own pool's memory and drop every opened peer pool."""

    def _listen_host(self) -> str | None:
        """Where the release listener binds: None for a socket file (readers on this host),
        else an address of this host for readers elsewhere."""
        return None

    def _peer_field(self) -> str:
        """The handle's ``peer`` field: what else a reader needs to reach this owner."""
        return ""

    def _encoding(self) -> str:
        """The ``encoding`` of this owner's handles: ``raw`` (blocks travel as they are)."""
        return "raw"

    def _encode(self, block_ids: list[int], layers: range) -> None:
        """Prepare ``layers`` of leased blocks for readers in the handle's encoding."""

    @property
    def owner_address(self) -> str | None:
        return self._listener.address if self._listener else None

    def register(self, pool: KVPool) -> None:
        if self._pool is not None:
            raise RuntimeError("this transport already has a registered pool")
        self._pool = pool
        self._pool_id = self._exported_pool_id(pool)
        if self._pool_id is not None:
            self._leases = LeaseTable(pool.allocator.free, pull_ttl_s=self._pull_ttl_s)
            self._listener = ReleaseListener(
                self._ctx,
                self._key,
                self._pool_id,
                self._leases,
                socket_dir=self._socket_dir,
                sweep_interval_s=self._sweep_interval_s,
                tcp_host=self._listen_host(),
            )
            if self._listener.path is not None:
                cleanup.track(self._listener.path)

    def export(
        self, req_id: str, block_ids: list[int], num_tokens: int, *, streamed: bool = False
    ) -> bytes:
        if (
            self._leases is None
            or self._listener is None
            or self._pool is None
            or self._pool_id is None  # set with _leases and _listener (register)
        ):
            raise RuntimeError("export needs a registered pool from create_pool")
        pool = self._pool
        if any(not 0 <= b < pool.num_blocks for b in block_ids):
            raise ValueError(f"block ids out of range [0, {pool.num_blocks}): {block_ids}")
        if not 0 < num_tokens <= len(block_ids) * pool.layout.block_size:
            raise ValueError(f"{num_tokens} tokens do not fit {len(block_ids)} blocks")
        if not streamed:
            self._encode(block_ids, range(pool.layout.num_layers))
        lease = self._leases.grant(block_ids, num_tokens, self._lease_ttl_s, req_id)
        handle = KVHandle(
            owner=self._listener.address,
            pool_id=self._pool_id,
            transport=self.name,
            layout=pool.layout,
            lease_id=lease.lease_id,
            block_ids=lease.block_ids,
            num_tokens=num_tokens,
            expiry=lease.expiry,
            peer=self._peer_field(),
            encoding=self._encoding(),
        )
        return encode_handle(handle, self._key)

    def publish_layers(self, block_ids: list[int], layers: range) -> None:
        num_layers = self._pool.layout.num_layers if self._pool is not None else 0
        if not 0 <= layers.start < layers.stop <= num_layers:
            raise ValueError(f"layers {layers} are not a range of the registered pool's layers")
        self._encode(block_ids, layers)

    def fetch(self, handle: bytes, dst_block_ids: list[int], skip: int = 0) -> None:
        if self._pool is None:
            raise RuntimeError("fetch needs a registered pool")
        self.fetch_layers(handle, dst_block_ids, range(self._pool.layout.num_layers), skip)

    def fetch_layers(
        self, handle: bytes, dst_block_ids: list[int], layers: range, skip: int = 0
    ) -> None:
        if self._pool is None:
            raise RuntimeError("fetch needs a registered pool")
        pool = self._pool
        h = self._verify(handle, margin_s=self._read_margin_s)
        with self._released_lock:
            if h.lease_id in self._released:
                raise InvalidHandle("KV handle already released here (replayed handle)")
        if h.layout != pool.layout:
            raise ValueError(f"handle layout {h.layout} differs from the local {pool.layout}")
        if not 0 <= skip <= len(h.block_ids):
            raise ValueError(f"cannot skip {skip} of the handle's {len(h.block_ids)} blocks")
        wanted = len(h.block_ids) - skip
        if len(dst_block_ids) != wanted or len(set(dst_block_ids)) != len(dst_block_ids):
            raise ValueError(f"need {wanted} distinct destination blocks")
        if any(not 0 <= b < pool.num_blocks for b in dst_block_ids):
            raise ValueError(f"destination ids out of range [0, {pool.num_blocks})")
        if not 0 <= layers.start < layers.stop <= pool.layout.num_layers or layers.step != 1:
            raise ValueError(f"layers {layers} are not a range of this pool's layers")
        started = time.perf_counter_ns()
        moved = 0
        if dst_block_ids:  # every block cached here: nothing to read
            moved = self._copy_in(replace(h, block_ids=h.block_ids[skip:]), dst_block_ids, layers)
        self._fetch_counts["fetch_ns"] += time.perf_counter_ns() - started
        self._fetch_counts["fetched_bytes"] += moved
        if h.encoding != "raw":
            self._fetch_counts[f"fetched_{h.encoding}_bytes"] += moved
        self._fetch_counts["fetches"] += layers.stop == pool.layout.num_layers
        self._fetch_counts["fetched_layers"] += len(layers)

    def release(self, handle: bytes) -> None:
        h = self._verify(handle, margin_s=None)
        now = time.time()
        with self._released_lock:
            self._released[h.lease_id] = h.expiry
            while self._released and next(iter(self._released.values())) < now:
                self._released.popitem(last=False)
        self._notify(h, RELEASE)

    def stats(self) -> dict[str, int]:
        counts = {"dropped_messages": self._sender.dropped, **self._fetch_counts}
        if self._leases is not None and self._listener is not None:
            counts.update(asdict(self._leases.stats()))
            counts.update(self._listener.counts)
        return counts

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._listener is not None:
            self._listener.close()
            if self._listener.path is not None:
                cleanup.untrack(self._listener.path)
        self._sender.close()
        self._close_memory()
        self._ctx.term()

    def _verify(self, data: bytes, *, margin_s: float | None) -> KVHandle:
        h = decode_handle(
            data, self._key, margin_s=margin_s or 0.0, check_expiry=margin_s is not None
        )
        if h.transport != self.name:
            raise InvalidHandle(f"KV handle is for transport {h.transport!r}, not {self.name!r}")
        return h

    def _notify(self, h: KVHandle, kind: int) -> None:
        if self._leases is not None and h.pool_id == self._pool_id:
            if kind == PULL:
                self._leases.mark_pulled(h.lease_id)
            else:
                self._leases.release(h.lease_id)
        else:
            self._sender.send(h.owner, kind, h.pool_id, h.lease_id)


class MappedTransport(LeasedTransport):
    """A transport whose readers map the owner's pool into their address space (shm, CUDA
    IPC) and copy out of it directly."""

    @abstractmethod
    def _open(self, handle: KVHandle) -> torch.Tensor:
        """The owner's pool tensor, opened once per pool id and cached; raises InvalidHandle
        if it cannot be opened or does not match the handle's layout."""

    def _copy_in(self, handle: KVHandle, dst_block_ids: list[int], layers: range) -> int:
        assert self._pool is not None  # fetch checked it
        src = self._open(handle)
        if max(handle.block_ids) >= src.shape[1]:
            raise InvalidHandle(f"KV handle names blocks beyond the owner's {src.shape[1]}")
        self._notify(handle, PULL)
        span = slice(layers.start, layers.stop)
        copy_blocks(src[span], handle.block_ids, self._pool.tensor[span], dst_block_ids)
        layout = self._pool.layout
        return len(dst_block_ids) * layout.block_bytes // layout.num_layers * len(layers)
