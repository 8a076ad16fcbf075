"""KV transport over NIXL (UCX backend): prefill and decode on different hosts.

The owner registers its pool with its NIXL agent once (DRAM on CPUs, VRAM on GPUs) and serves
two small endpoints on its advertised host: the release channel (``tcp://``, as for shm) and the
signed metadata endpoint (``nixl_metadata``), named in every handle's ``peer``. A reader asks
each owner for its metadata once, checks the MAC, adds the agent, and then READs a handle's
blocks straight into blocks of its own pool: one descriptor per layer and contiguous run.

With ``transfer_dtype="fp8"`` the owner encodes a lease's blocks as e4m3 with per-head scales
(``splitserve_kernels.fp8_encode_blocks``) into a registered copy of its pool (the wire pool)
when it exports them, and the handle says ``fp8``; a reader then READs those bytes into a wire
pool of its own (made at its first fp8 handle) and decodes them into its blocks. About half the
bytes of bfloat16 cross the link.

A READ that has not finished by ``transfer_timeout_s`` is abandoned. NIXL cannot cancel a
posted READ (releasing its handle leaves the bytes landing), so its destination blocks are held
here, not returned to the caller (``BlocksStillWritten``), until the transfer settles; the owner's
lease then expires on its side.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import splitserve_kernels as kernels
from splitserve.kv.allocator import BlocksStillWritten
from splitserve.kv.handle import InvalidHandle, KVHandle
from splitserve.kv.layout import KVLayout
from splitserve.kv.lease import LockedAllocator
from splitserve.kv.pool import KVPool
from splitserve.transport.channel import PULL
from splitserve.transport.leased import LeasedTransport, contiguous_runs, copy_blocks
from splitserve.transport.nixl_metadata import MetadataServer, PeerPool, request_pool

log = logging.getLogger(__name__)

ADVERTISE_ENV = "SPLITSERVE_ADVERTISE_HOST"
UCX_DEFAULTS = {
    "UCX_TCP_TX_SEG_SIZE": "256k",
    "UCX_TCP_RX_SEG_SIZE": "256k",
    "UCX_TCP_SNDBUF": "4m",
    "UCX_TCP_RCVBUF": "4m",
}
"""UCX settings this transport starts its agent with unless the environment sets them: UCX's
8 KiB TCP segments held a 10 Gbit/s link to half its TCP rate (BENCHMARKS.md, "KV over the
link")."""
TRANSFER_DTYPES = ("auto", "fp8")
"""``auto``: blocks travel in the pool's dtype; ``fp8``: as e4m3 with per-head block scales."""


def default_advertise_host() -> str:
    """``$SPLITSERVE_ADVERTISE_HOST``, else what this host's name resolves to (a pod's IP in
    Kubernetes)."""
    return os.environ.get(ADVERTISE_ENV) or socket.gethostbyname(socket.gethostname())


def _mem_of(pool: KVPool) -> tuple[str, int]:
    device = pool.device
    return ("VRAM", device.index or 0) if device.type == "cuda" else ("DRAM", 0)


class _Progress:
    """Owner side: drives the agent's UCX worker, which answers the readers' READs. Busy (a
    pause of ``BUSY_S``) for ``BUSY_WINDOW_S`` after each reader's PULL notice (its READ
    follows) while that lease is being read, else every ``IDLE_S``. Bounded, because a
    streamed lease is being read for its whole prompt pass: a busy loop that long takes CPU
    the pass needs."""

    BUSY_S = 20e-6
    IDLE_S = 2e-3
    BUSY_WINDOW_S = 0.005

    def __init__(self, agent: Any, being_read: Callable[[], int]) -> None:
        self._agent = agent
        self._being_read = being_read
        self._busy_until = 0.0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="splitserve-nixl-progress")
        self._thread.daemon = True
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._agent.get_new_notifs()
            except Exception:  # a peer's failure surfaces here too; the reader handles it
                log.debug("NIXL progress reported an error", exc_info=True)
            if self._wake.is_set():
                self._wake.clear()
                self._busy_until = time.monotonic() + self.BUSY_WINDOW_S
            if self._being_read() and time.monotonic() < self._busy_until:
                time.sleep(self.BUSY_S)
            else:
                self._wake.wait(self.IDLE_S)

    def wake(self) -> None:
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join()


class _Wire:
    """fp8 copies of a pool's blocks (e4m3 bytes, float32 scales per layer, block, K/V and
    head), at the same block ids, registered with the agent."""

    def __init__(self, agent: Any, pool: KVPool) -> None:
        layout = pool.layout
        shape = layout.pool_shape(pool.num_blocks)
        self.q = torch.zeros(shape, dtype=torch.uint8, device=pool.device)
        self.scales = torch.zeros((*shape[:3], layout.num_kv_heads), device=pool.device)
        mem, device_id = _mem_of(pool)
        regions = [
            (t.data_ptr(), t.numel() * t.element_size(), device_id, "") for t in self.tensors
        ]
        self._agent = agent
        self._registered = agent.register_memory(regions, mem)

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q, self.scales

    @staticmethod
    def layer_block_bytes(layout: KVLayout) -> tuple[int, int]:
        """Bytes of one layer of one block: e4m3 values, scales."""
        return layout.block_numel // layout.num_layers, 2 * layout.num_kv_heads * 4

    def close(self) -> None:
        self._agent.deregister_memory(self._registered)


def descriptor_table(
    base: int,
    layers: int,
    blocks: int,
    runs: np.ndarray,
    size: int,
    device_id: int,
) -> np.ndarray:
    """NIXL descriptors ``(address, bytes, device)`` of one region laid out like a pool
    (``[layers, blocks, ...]``, ``size`` bytes per layer and block): one per layer and run;
    ``runs`` is ``[n, 2]`` of (first block id on this side, length)."""
    layer = np.arange(layers, dtype=np.uint64)[:, None]
    starts, lengths = runs[:, 0].astype(np.uint64), runs[:, 1].astype(np.uint64)
    addr = np.uint64(base) + (layer * np.uint64(blocks) + starts[None, :]) * np.uint64(size)
    table = np.empty((addr.size, 3), dtype=np.uint64)
    table[:, 0] = addr.reshape(-1)
    table[:, 1] = np.broadcast_to(lengths * np.uint64(size), addr.shape).reshape(-1)
    table[:, 2] = device_id
    return table


@dataclass
class _Abandoned:
    xfer: Any
    block_ids: list[int]
    agent: str


class NixlTransport(LeasedTransport):
    """``KVTransport`` whose readers pull blocks over NIXL; pools on CPU or GPU."""

    name = "nixl"

    def __init__(
        self,
        key: bytes,
        *,
        advertise_host: str | None = None,
        transfer_timeout_s: float = 10.0,
        metadata_timeout_s: float = 5.0,
        transfer_dtype: str = "auto",
        peer_idle_s: float = 300.0,
        **options: Any,
    ) -> None:
        if transfer_timeout_s <= 0 or metadata_timeout_s <= 0:
            raise ValueError("transfer and metadata timeouts must be positive")
        if peer_idle_s <= 0:
            raise ValueError("peer_idle_s must be positive")
        if transfer_dtype not in TRANSFER_DTYPES:
            raise ValueError(f"transfer_dtype must be one of {TRANSFER_DTYPES}: {transfer_dtype!r}")
        super().__init__(key, **options)
        self._host = advertise_host or default_advertise_host()
        self._transfer_timeout_s = transfer_timeout_s
        self._metadata_timeout_s = metadata_timeout_s
        self._transfer_dtype = transfer_dtype
        self._peer_idle_s = peer_idle_s
        self._wire: _Wire | None = None
        """The own pool's fp8 copies: an owner's with ``transfer_dtype="fp8"``, a reader's from
        its first fp8 handle on."""
        self._agent: Any = None
        self._registered: Any = None
        self._own: tuple[bytes, KVPool] | None = None
        self._metadata: MetadataServer | None = None
        self._progress: _Progress | None = None
        self._peers: dict[bytes, PeerPool] = {}
        self._peer_used: dict[bytes, float] = {}
        """When each known owner pool was last read: an owner whose server restarted (a new
        pool, a new agent) or went away is forgotten after ``peer_idle_s`` without reads, or
        at once after a READ from it failed; a live one is asked for its metadata again."""
        self._abandoned: list[_Abandoned] = []
        self._to_forget: set[bytes] = set()
        """Owner pools to forget once their abandoned READs have settled."""
        self._counts = dict.fromkeys(("transfer_timeouts", "transfer_errors"), 0)

    @property
    def agent_name(self) -> str | None:
        return None if self._agent is None else str(self._agent.name)

    def _new_agent(self) -> Any:
        from nixl._api import nixl_agent, nixl_agent_config

        for key, value in UCX_DEFAULTS.items():
            os.environ.setdefault(key, value)  # UCX reads its settings when the agent starts
        name = f"splitserve-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        # No NIXL progress thread: it polls without pause, a whole core per agent even when idle.
        # A reader progresses its own READs while it waits for them; an owner, whose progress
        # answers them (UCX emulates RMA over TCP), runs ``_Progress``.
        return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))

    def create_pool(
        self, layout: KVLayout, num_blocks: int, device: torch.device | str = "cpu"
    ) -> KVPool:
        if self._own is not None:
            raise RuntimeError("this transport already created its pool")
        pool = KVPool(layout, num_blocks, device, allocator=LockedAllocator(num_blocks))
        self._own = (secrets.token_bytes(16), pool)
        return pool

    def register(self, pool: KVPool) -> None:
        if self._agent is not None:
            raise RuntimeError("this transport already has a registered pool")
        if not pool.tensor.is_contiguous():
            raise ValueError("a NIXL-registered KV pool must be one contiguous tensor")
        self._agent = self._new_agent()
        mem, device_id = _mem_of(pool)
        nbytes = pool.num_blocks * pool.layout.block_bytes
        self._registered = self._agent.register_memory(
            [(pool.tensor.data_ptr(), nbytes, device_id, "")], mem
        )
        super().register(pool)
        if self._own is not None and self._own[1] is pool:
            if self._transfer_dtype == "fp8":
                self._wire = _Wire(self._agent, pool)
            wire = self._wire.tensors if self._wire is not None else None
            own = PeerPool(
                agent_name=self._agent.name,
                base=pool.tensor.data_ptr(),
                nbytes=nbytes,
                device_id=device_id,
                mem=mem,
                num_blocks=pool.num_blocks,
                metadata=self._agent.get_agent_metadata(),
                wire_base=wire[0].data_ptr() if wire else 0,
                scales_base=wire[1].data_ptr() if wire else 0,
            )
            self._metadata = MetadataServer(self._ctx, self._key, self._host, self._own[0], own)
            assert self._leases is not None  # set by register for an exported pool
            self._progress = _Progress(self._agent, self._leases.being_read)

    def _pulled(self) -> None:
        if self._progress is not None:
            self._progress.wake()

    def _encoding(self) -> str:
        return "fp8" if self._wire is not None and self._own is not None else "raw"

    def _encode(self, block_ids: list[int], layers: range) -> None:
        if self._wire is None or self._own is None:
            return
        ids = torch.tensor(block_ids, dtype=torch.long)
        span = slice(layers.start, layers.stop)
        pool, q, scales = self._own[1].tensor[span], self._wire.q[span], self._wire.scales[span]
        kernels.fp8_encode_blocks(pool, ids, q, scales, ids)

    def _exported_pool_id(self, pool: KVPool) -> bytes | None:
        return self._own[0] if self._own is not None and self._own[1] is pool else None

    def _listen_host(self) -> str | None:
        return self._host

    def _peer_field(self) -> str:
        assert self._metadata is not None  # export runs only on a registered own pool
        return self._metadata.address

    def _peer(self, h: KVHandle) -> PeerPool:
        now = time.monotonic()
        for pool_id, used in list(self._peer_used.items()):
            if now - used > self._peer_idle_s and pool_id != h.pool_id:
                self._forget(pool_id, "idle")
        peer = self._peers.get(h.pool_id)
        if peer is None:
            if not h.peer.startswith("tcp://"):
                raise InvalidHandle(f"KV handle names no NIXL metadata endpoint ({h.peer!r})")
            peer = request_pool(self._ctx, self._key, h.peer, h.pool_id, self._metadata_timeout_s)
            if peer.nbytes != peer.num_blocks * h.layout.block_bytes:
                raise InvalidHandle("KV owner's pool does not hold whole blocks of this layout")
            added = self._agent.add_remote_agent(peer.metadata)
            added = added.decode() if isinstance(added, bytes) else str(added)
            if added != peer.agent_name:
                raise InvalidHandle(f"KV owner's metadata names agent {added!r}")
            self._peers[h.pool_id] = peer
        self._peer_used[h.pool_id] = now
        return peer

    def _forget(self, pool_id: bytes, why: str) -> None:
        """Drop a known owner pool and its NIXL remote agent; once its abandoned READs have
        settled, if some have not yet (``reap``)."""
        peer = self._peers.get(pool_id)
        self._to_forget.discard(pool_id)
        if peer is None:
            return
        if any(item.agent == peer.agent_name for item in self._abandoned):
            self._to_forget.add(pool_id)
            return
        del self._peers[pool_id]
        self._peer_used.pop(pool_id, None)
        try:
            self._agent.remove_remote_agent(peer.agent_name)
        except Exception:  # nixl's binding errors share no base class beyond Exception
            log.warning("could not remove the NIXL agent %s", peer.agent_name, exc_info=True)
        log.info("forgot the KV owner %s (%s)", peer.agent_name, why)

    def _copy_in(self, handle: KVHandle, dst_block_ids: list[int], layers: range) -> int:
        assert self._pool is not None  # fetch checked it
        self.reap()
        layout = self._pool.layout
        span = slice(layers.start, layers.stop)
        if self._own is not None and handle.pool_id == self._own[0]:
            self._notify(handle, PULL)
            own = self._own[1].tensor[span]
            copy_blocks(own, handle.block_ids, self._pool.tensor[span], dst_block_ids)
            return len(dst_block_ids) * layout.block_bytes // layout.num_layers * len(layers)
        peer = self._peer(handle)
        if max(handle.block_ids) >= peer.num_blocks:
            raise InvalidHandle(f"KV handle names blocks beyond the owner's {peer.num_blocks}")
        runs = np.array(contiguous_runs(handle.block_ids, dst_block_ids), dtype=np.uint64)
        runs = runs.reshape(-1, 3)
        mem, device_id = _mem_of(self._pool)
        if handle.encoding == "fp8":
            if not peer.wire_base or not peer.scales_base:
                raise InvalidHandle("KV handle says fp8 but its owner has no fp8 blocks")
            wire = self._reader_wire()
            sizes = _Wire.layer_block_bytes(layout)
            regions = [
                (wire.q.data_ptr(), peer.wire_base, sizes[0]),
                (wire.scales.data_ptr(), peer.scales_base, sizes[1]),
            ]
        else:
            regions = [
                (self._pool.tensor.data_ptr(), peer.base, layout.block_bytes // layout.num_layers)
            ]
        n, own_blocks, first = len(layers), self._pool.num_blocks, layers.start
        local = np.concatenate(
            [descriptor_table(base + first * own_blocks * size, n, own_blocks, runs[:, 1:], size,
                              device_id)
             for base, _, size in regions]
        )  # fmt: skip
        remote = np.concatenate(
            [descriptor_table(base + first * peer.num_blocks * size, n, peer.num_blocks,
                              runs[:, [0, 2]], size, peer.device_id)
             for _, base, size in regions]
        )  # fmt: skip
        self._notify(handle, PULL)
        try:
            self._read(peer, local, remote, mem, dst_block_ids)
        except BlocksStillWritten:
            raise  # a stalled owner may answer yet: its READ is abandoned, not failed
        except Exception:
            self._forget(handle.pool_id, "a READ from it failed")
            raise
        if handle.encoding == "fp8":
            assert self._wire is not None
            ids = torch.tensor(dst_block_ids, dtype=torch.long)
            q, scales = self._wire.q[span], self._wire.scales[span]
            kernels.fp8_decode_blocks(q, scales, ids, self._pool.tensor[span], ids)
        return int(local[:, 1].sum())

    def _reader_wire(self) -> _Wire:
        if self._wire is None:
            assert self._pool is not None
            log.info("first fp8 KV handle: making this reader's fp8 copy of its pool")
            self._wire = _Wire(self._agent, self._pool)
        return self._wire

    def _state(self, xfer: Any, post: bool = False) -> str:
        """``PROC``, ``DONE`` or ``ERR``; NIXL raises for a failed transfer (a peer that
        disconnected), which is ``ERR`` here."""
        try:
            return str(self._agent.transfer(xfer) if post else self._agent.check_xfer_state(xfer))
        except Exception as exc:  # nixl's binding errors share no base class beyond Exception
            log.warning("KV transfer failed: %r", exc)
            return "ERR"

    def _release_xfer(self, xfer: Any) -> None:
        try:
            self._agent.release_xfer_handle(xfer)
        except Exception:  # a failed transfer's handle; the agent frees it at close
            log.warning("could not release a KV transfer handle", exc_info=True)

    def _read(
        self, peer: PeerPool, local: np.ndarray, remote: np.ndarray, mem: str, dst: list[int]
    ) -> None:
        """READ ``remote`` descriptors of ``peer`` into ``local`` ones; ``dst`` are the blocks
        they write (held, if the READ is abandoned)."""
        xfer = self._agent.initialize_xfer(
            "READ",
            self._agent.get_xfer_descs(local, mem),
            self._agent.get_xfer_descs(remote, peer.mem),
            peer.agent_name,
        )
        deadline = time.monotonic() + self._transfer_timeout_s
        state = self._state(xfer, post=True)
        pause = 20e-6
        while state == "PROC":
            if time.monotonic() > deadline:
                self._counts["transfer_timeouts"] += 1
                self._abandoned.append(_Abandoned(xfer, list(dst), peer.agent_name))
                raise BlocksStillWritten(
                    f"KV transfer from {peer.agent_name} did not finish within "
                    f"{self._transfer_timeout_s:g} s",
                    dst,
                )
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
            state = self._state(xfer)
        self._release_xfer(xfer)
        if state != "DONE":
            self._counts["transfer_errors"] += 1
            raise RuntimeError(f"KV transfer from {peer.agent_name} failed ({state})")

    def reap(self) -> int:
        """Return the blocks of abandoned transfers that have settled; how many are still held.
        Runs on the reader's own thread (its allocator is not locked)."""
        assert self._pool is not None
        held, failed = [], set()
        for item in self._abandoned:
            state = self._state(item.xfer)
            if state == "PROC":
                held.append(item)
                continue
            if state != "DONE":
                failed.add(item.agent)
            self._release_xfer(item.xfer)
            self._pool.allocator.free(item.block_ids)
        self._abandoned = held
        for pool_id, peer in list(self._peers.items()):
            if peer.agent_name in failed or pool_id in self._to_forget:
                self._forget(pool_id, "a READ from it failed")
        return sum(len(item.block_ids) for item in held)

    def stats(self) -> dict[str, int]:
        held = sum(len(item.block_ids) for item in self._abandoned)
        counts = {**super().stats(), **self._counts, "held_blocks": held, "peers": len(self._peers)}
        if self._metadata is not None:
            counts.update({f"metadata_{k}": v for k, v in self._metadata.counts.items()})
        return counts

    def _close_memory(self) -> None:
        if self._metadata is not None:
            self._metadata.close()
        if self._progress is not None:
            self._progress.close()
        if self._agent is None:
            return
        for item in self._abandoned:
            self._release_xfer(item.xfer)
        self._abandoned.clear()
        for peer in self._peers.values():
            self._agent.remove_remote_agent(peer.agent_name)
        self._peers.clear()
        self._peer_used.clear()
        self._to_forget.clear()
        if self._wire is not None:
            self._wire.close()
            self._wire = None
        if self._registered is not None:
            self._agent.deregister_memory(self._registered)
        self._agent = None
