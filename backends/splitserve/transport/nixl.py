"""KV transport over NIXL (UCX backend): prefill and decode on different hosts.

The owner registers its pool with its NIXL agent once (DRAM on CPUs, VRAM on GPUs) and serves
two small endpoints on its advertised host: the release channel (``tcp://``, as for shm) and the
signed metadata endpoint (``nixl_metadata``), named in every handle's ``peer``. A reader asks
each owner for its metadata once, checks the MAC, adds the agent (the owners it knows:
``nixl_peers``), and then READs a handle's blocks straight into blocks of its own pool: one
descriptor per layer and contiguous run.

With ``transfer_dtype="fp8"`` the owner encodes a lease's blocks as e4m3 with per-head scales
(``splitserve_kernels.fp8_encode_blocks``) into a registered copy of its pool (the wire pool)
when it exports them, and the handle says ``fp8``; a reader then READs those bytes into a wire
pool of its own (made at its first fp8 handle) and decodes them into its blocks. About half the
bytes of bfloat16 cross the link.

A READ that has not finished by ``transfer_timeout_s`` is abandoned. NIXL cannot cancel a
posted READ (releasing its handle leaves the bytes landing), so its destination blocks are held
(``nixl_peers``), not returned to the caller (``BlocksStillWritten``), until the transfer
settles; the owner's lease then expires on its side.

Pushes (prefill WRITEs a prompt's layers into blocks decode named): decode's end is here and in
``nixl_push``, prefill's end posts and follows its WRITEs in ``nixl_push_sender``; both ends'
transfers are posted and polled by ``nixl_xfers``.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from typing import Any

import numpy as np
import torch

import splitserve_kernels as kernels
from splitserve.kv.allocator import BlocksStillWritten
from splitserve.kv.handle import InvalidHandle, KVHandle, encode_handle
from splitserve.kv.layout import KVLayout
from splitserve.kv.lease import LockedAllocator
from splitserve.kv.pool import KVPool
from splitserve.transport.channel import PULL
from splitserve.transport.leased import LeasedTransport, contiguous_runs, copy_blocks
from splitserve.transport.nixl_metadata import MetadataServer, PeerPool
from splitserve.transport.nixl_parts import Wire, descriptor_table, mem_of, new_agent
from splitserve.transport.nixl_peers import Peers
from splitserve.transport.nixl_push import IncomingPushes
from splitserve.transport.nixl_push_sender import COUNTS as PUSH_COUNTS
from splitserve.transport.nixl_push_sender import PushSender
from splitserve.transport.nixl_xfers import Transfers

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
        accept_pushes: bool = False,
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
        self._wire: Wire | None = None
        """The own pool's fp8 copies: an owner's with ``transfer_dtype="fp8"``, a reader's from
        its first fp8 handle on."""
        self._agent: Any = None
        self._registered: Any = None
        self._own: tuple[bytes, KVPool] | None = None
        self._metadata: MetadataServer | None = None
        self._peers: Peers | None = None
        """The owner pools read from (and push targets' pools), from registration on."""
        self._counts = dict.fromkeys(("transfer_timeouts", "transfer_errors"), 0)
        self._incoming = IncomingPushes(transfer_timeout_s) if accept_pushes else None
        """A reader's pushes (``push_target``): its registered pool takes prefill's WRITEs."""
        self._push_pool_id = secrets.token_bytes(16)
        self._xfers: Transfers | None = None
        self._pushes: PushSender | None = None
        """An owner's pushes (``open_push``), from registration on."""
        self._warned_raw_push = False

    @property
    def agent_name(self) -> str | None:
        return None if self._agent is None else str(self._agent.name)

    def _new_agent(self) -> Any:
        for key, value in UCX_DEFAULTS.items():
            os.environ.setdefault(key, value)  # UCX reads its settings when the agent starts
        return new_agent(f"splitserve-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")

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
        self._xfers = Transfers(self._agent)
        self._pushes = PushSender(self._xfers, self._transfer_timeout_s)
        self._peers = Peers(
            self._xfers, self._ctx, self._key, self._metadata_timeout_s, self._peer_idle_s
        )
        mem, device_id = mem_of(pool)
        nbytes = pool.num_blocks * pool.layout.block_bytes
        self._registered = self._agent.register_memory(
            [(pool.tensor.data_ptr(), nbytes, device_id, "")], mem
        )
        super().register(pool)
        exported = self._own is not None and self._own[1] is pool
        if not exported and self._incoming is None:
            return
        # An owner encodes its leases into the wire copy; a reader taking pushes gets fp8
        # pushes in it.
        if self._transfer_dtype == "fp8":
            self._wire = Wire(self._agent, pool)
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
        pool_id = self._own[0] if self._own is not None and exported else self._push_pool_id
        self._metadata = MetadataServer(self._ctx, self._key, self._host, pool_id, own)

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

    def _peer_table(self) -> Peers:
        assert self._peers is not None  # made with the agent, before any transfer
        return self._peers

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
        peers = self._peer_table()
        peer = peers.reach(handle)
        if max(handle.block_ids) >= peer.num_blocks:
            raise InvalidHandle(f"KV handle names blocks beyond the owner's {peer.num_blocks}")
        if handle.encoding == "fp8" and (not peer.wire_base or not peer.scales_base):
            raise InvalidHandle("KV handle says fp8 but its owner has no fp8 blocks")
        runs = np.array(contiguous_runs(handle.block_ids, dst_block_ids), dtype=np.uint64)
        runs = runs.reshape(-1, 3)
        local, remote = self._descriptors(
            peer, runs[:, 1:], runs[:, [0, 2]], layers, handle.encoding
        )
        mem = mem_of(self._pool)[0]
        self._notify(handle, PULL)
        try:
            self._read(peer, local, remote, mem, dst_block_ids)
        except BlocksStillWritten:
            raise  # a stalled owner may answer yet: its READ is abandoned, not failed
        except Exception:
            peers.forget(handle.pool_id, "a READ from it failed")
            raise
        if handle.encoding == "fp8":
            assert self._wire is not None
            ids = torch.tensor(dst_block_ids, dtype=torch.long)
            q, scales = self._wire.q[span], self._wire.scales[span]
            kernels.fp8_decode_blocks(q, scales, ids, self._pool.tensor[span], ids)
        return int(local[:, 1].sum())

    def _descriptors(
        self,
        peer: PeerPool,
        local_runs: np.ndarray,
        remote_runs: np.ndarray,
        layers: range,
        encoding: str,
    ) -> tuple[np.ndarray, np.ndarray]:
        """NIXL descriptors of ``layers`` of runs of blocks here and at ``peer`` (``[n, 2]``:
        first block, length), in the pool's dtype or as fp8 (the wire copies and scales)."""
        assert self._pool is not None
        layout = self._pool.layout
        device_id = mem_of(self._pool)[1]
        if encoding == "fp8":
            wire = self._reader_wire()
            sizes = Wire.layer_block_bytes(layout)
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
            [descriptor_table(base + first * own_blocks * size, n, own_blocks, local_runs, size,
                              device_id)
             for base, _, size in regions]
        )  # fmt: skip
        remote = np.concatenate(
            [descriptor_table(base + first * peer.num_blocks * size, n, peer.num_blocks,
                              remote_runs, size, peer.device_id)
             for _, base, size in regions]
        )  # fmt: skip
        return local, remote

    def _reader_wire(self) -> Wire:
        if self._wire is None:
            assert self._pool is not None
            log.info("first fp8 KV handle: making this reader's fp8 copy of its pool")
            self._wire = Wire(self._agent, self._pool)
        return self._wire

    def _read(
        self, peer: PeerPool, local: np.ndarray, remote: np.ndarray, mem: str, dst: list[int]
    ) -> None:
        """READ ``remote`` descriptors of ``peer`` into ``local`` ones; ``dst`` are the blocks
        they write (held, if the READ is abandoned)."""
        xfers = self._transfers()
        xfer = xfers.prepare("READ", local, mem, remote, peer)
        deadline = time.monotonic() + self._transfer_timeout_s
        state: str | None = xfers.state(xfer, post=True)
        if state == "PROC":
            running, state = xfers.wait([xfer], deadline)
            if running:
                self._counts["transfer_timeouts"] += 1
                self._peer_table().abandon(xfer, dst, peer)
                raise BlocksStillWritten(
                    f"KV transfer from {peer.agent_name} did not finish within "
                    f"{self._transfer_timeout_s:g} s",
                    dst,
                )
        else:
            xfers.release(xfer)
            state = None if state == "DONE" else state
        if state is not None:
            self._counts["transfer_errors"] += 1
            raise RuntimeError(f"KV transfer from {peer.agent_name} failed ({state})")

    # pushes, decode's end: prefill WRITEs into blocks named in a target (``nixl_push``)

    @property
    def accepts_pushes(self) -> bool:
        return self._incoming is not None and self._metadata is not None

    def push_target(self, dst_block_ids: list[int], num_tokens: int) -> bytes:
        """A signed target naming ``dst_block_ids`` of the registered pool (holding
        ``num_tokens`` tokens) for a prefill to push a prompt's KV into; until
        ``push_arrived`` or ``push_failed`` the blocks are the push's."""
        if self._incoming is None or self._metadata is None or self._pool is None:
            raise RuntimeError("push_target needs a registered pool and accept_pushes")
        layout = self._pool.layout
        if not dst_block_ids or not 0 < num_tokens <= len(dst_block_ids) * layout.block_size:
            raise ValueError(f"{num_tokens} tokens do not fit {len(dst_block_ids)} blocks")
        target = KVHandle(
            owner="",
            pool_id=self._push_pool_id,
            transport=self.name,
            layout=layout,
            lease_id=secrets.token_bytes(16),
            block_ids=tuple(dst_block_ids),
            num_tokens=num_tokens,
            expiry=time.time() + self._lease_ttl_s,
            peer=self._metadata.address,
            encoding="fp8" if self._wire is not None else "raw",
        )
        self._incoming.opened(target.lease_id, dst_block_ids)
        return encode_handle(target, self._key)

    def push_arrived(self, target: bytes) -> None:
        """Prefill answered the call that carried ``target``: its blocks hold the KV (decoded
        into the pool here where it came as fp8)."""
        assert self._incoming is not None and self._pool is not None
        h = self._verify(target, margin_s=None)
        self._incoming.arrived(h.lease_id)
        layout = self._pool.layout
        moved = len(h.block_ids) * layout.block_bytes
        if h.encoding == "fp8":
            assert self._wire is not None
            ids = torch.tensor(h.block_ids, dtype=torch.long)
            kernels.fp8_decode_blocks(self._wire.q, self._wire.scales, ids, self._pool.tensor, ids)
            sizes = Wire.layer_block_bytes(layout)
            moved = len(h.block_ids) * layout.num_layers * sum(sizes)
            self._fetch_counts["fetched_fp8_bytes"] += moved
        self._fetch_counts["fetched_bytes"] += moved
        self._fetch_counts["fetches"] += 1
        self._fetch_counts["fetched_layers"] += layout.num_layers

    def push_failed(self, target: bytes, why: str) -> BlocksStillWritten:
        """The call that carried ``target`` failed or was dropped: its blocks stay out of the
        pool until the push settles (``reap_pushes``); raise what this returns."""
        assert self._incoming is not None
        h = self._verify(target, margin_s=None)
        blocks = self._incoming.failed(h.lease_id, h.expiry)
        return BlocksStillWritten(f"the prompt's KV push failed: {why}", blocks)

    def reap_pushes(self) -> None:
        """Hear prefill's notifications, and return the blocks of failed pushes that nothing can
        write any more to the pool. On the thread that owns the pool's allocator."""
        if self._incoming is not None and self._pool is not None:
            try:
                notifs = self._agent.get_new_notifs()
            except Exception:  # nixl's binding errors share no base class beyond Exception
                log.warning("could not read NIXL notifications", exc_info=True)
                notifs = {}
            for messages in notifs.values():
                for message in messages:
                    self._incoming.heard(bytes(message))
            freed = self._incoming.reap()
            if freed:
                self._pool.allocator.free(freed)

    # pushes, prefill's end

    def open_push(self, target: bytes, src_block_ids: list[int]) -> bytes:
        """Check ``target`` and reach its pool; the layers of the last ``len(target's blocks)``
        of ``src_block_ids`` go there with ``push_layers``. Returns the push's key. Raises
        InvalidHandle or ValueError (nothing posted) for a target that cannot be pushed into."""
        if self._own is None or self._pool is not self._own[1]:
            raise RuntimeError("open_push needs a registered pool from create_pool")
        h = self._verify(target, margin_s=0.0)
        layout = self._pool.layout
        if h.layout != layout:
            raise ValueError(f"push target layout {h.layout} differs from the local {layout}")
        if len(h.block_ids) > len(src_block_ids):
            raise ValueError(
                f"push target names {len(h.block_ids)} blocks, the prompt has {len(src_block_ids)}"
            )
        if h.encoding == "fp8" and self._wire is None:
            raise ValueError(
                "the decode server takes fp8 KV: start prefill with --kv-transfer-dtype fp8 too"
            )
        if h.encoding == "raw" and self._wire is not None and not self._warned_raw_push:
            self._warned_raw_push = True
            log.warning(
                "a decode server asks for KV pushes in the pool's dtype: they go unencoded; "
                "start it with --kv-transfer-dtype fp8 too for fp8 on the wire"
            )
        sender = self._push_sender()
        sender.claim(h)
        sender.settle_abandoned()
        peer = self._peer_table().reach(h)
        if max(h.block_ids) >= peer.num_blocks:
            raise InvalidHandle(f"push target names blocks beyond the pool's {peer.num_blocks}")
        if h.encoding == "fp8" and (not peer.wire_base or not peer.scales_base):
            raise InvalidHandle("push target says fp8 but its pool has no fp8 blocks")
        src = list(src_block_ids[len(src_block_ids) - len(h.block_ids) :])
        return sender.open(h, peer.agent_name, src)

    def push_layers(self, key: bytes, layers: range) -> None:
        """WRITE ``layers`` (written by the pass) of an open push; returns once posted. After
        the target's expiry or a failed WRITE nothing more is posted (``finish_push`` says)."""
        push = self._push_sender().writable(key)
        if push is None:
            return
        started = time.perf_counter_ns()
        h = push.target
        if h.encoding == "fp8":
            self._encode(push.src_block_ids, layers)
        peer = self._peer_table().known(h.pool_id)
        runs = np.array(contiguous_runs(push.src_block_ids, h.block_ids), dtype=np.uint64)
        runs = runs.reshape(-1, 3)
        local, remote = self._descriptors(peer, runs[:, [0, 2]], runs[:, 1:], layers, h.encoding)
        assert self._pool is not None  # open_push checked it
        mem = mem_of(self._pool)[0]
        self._push_sender().write(push, local, mem, remote, peer, len(layers), started)

    def finish_push(self, key: bytes) -> None:
        """Wait until every WRITE of the push is done (the KV is in the target's blocks), then
        tell the target it settled. Raises if a WRITE failed, the target expired before the last
        layer, or the WRITEs missed the transfer timeout (then they are left to settle and the
        target hears of it when they have)."""
        self._push_sender().finish(key)

    def _push_sender(self) -> PushSender:
        if self._pushes is None:
            raise RuntimeError("pushes need a registered pool")
        return self._pushes

    def _transfers(self) -> Transfers:
        assert self._xfers is not None  # made with the agent, before any transfer
        return self._xfers

    def reap(self) -> int:
        """Return the blocks of abandoned transfers that have settled; how many are still held.
        Runs on the reader's own thread (its allocator is not locked)."""
        assert self._pool is not None
        peers = self._peer_table()
        freed = peers.settle()
        if freed:
            self._pool.allocator.free(freed)
        return peers.held_blocks

    def stats(self) -> dict[str, int]:
        peers = self._peers
        counts = {
            **super().stats(),
            **self._counts,
            "held_blocks": 0 if peers is None else peers.held_blocks,
            "peers": 0 if peers is None else len(peers),
        }
        counts.update(self._pushes.counts if self._pushes else dict.fromkeys(PUSH_COUNTS, 0))
        if self._incoming is not None:
            counts.update(self._incoming.counts)
        if self._metadata is not None:
            counts.update({f"metadata_{k}": v for k, v in self._metadata.counts.items()})
        return counts

    def _close_memory(self) -> None:
        if self._metadata is not None:
            self._metadata.close()
        if self._agent is None:
            return
        if self._pushes is not None:
            self._pushes.close()
        self._peer_table().close()
        if self._wire is not None:
            self._wire.close()
            self._wire = None
        if self._registered is not None:
            self._agent.deregister_memory(self._registered)
        self._agent = None
