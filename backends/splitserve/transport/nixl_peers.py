"""The KV owners a NIXL agent reaches: each owner pool's metadata and remote agent, and the READs
abandoned with them.

A pool is asked for its metadata (``nixl_metadata``) the first time a handle names it and kept
while it is read. It is forgotten after ``idle_s`` without reads (an owner whose server
restarted has a new pool and a new agent, or went away), or at once after a READ from it failed;
a live one is asked again. A READ past its deadline cannot be cancelled, so it is kept here with
its destination blocks until it settles, and its owner's agent is kept until then too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import zmq

from splitserve.kv.handle import InvalidHandle, KVHandle
from splitserve.transport.nixl_metadata import PeerPool, request_pool
from splitserve.transport.nixl_xfers import Transfers

log = logging.getLogger(__name__)


@dataclass
class _Abandoned:
    xfer: Any
    block_ids: list[int]
    agent: str


class Peers:
    def __init__(
        self,
        xfers: Transfers,
        ctx: zmq.Context,
        key: bytes,
        metadata_timeout_s: float,
        idle_s: float,
    ) -> None:
        self._xfers = xfers
        self._ctx = ctx
        self._key = key
        self._metadata_timeout_s = metadata_timeout_s
        self._idle_s = idle_s
        self._pools: dict[bytes, PeerPool] = {}
        self._used: dict[bytes, float] = {}
        """When each known pool was last reached."""
        self._abandoned: list[_Abandoned] = []
        self._to_forget: set[bytes] = set()
        """Pools to forget once their abandoned READs have settled."""

    def __len__(self) -> int:
        return len(self._pools)

    @property
    def held_blocks(self) -> int:
        """Destination blocks of abandoned READs that have not settled."""
        return sum(len(item.block_ids) for item in self._abandoned)

    def reach(self, h: KVHandle) -> PeerPool:
        """The pool ``h`` names, asked for and added as a remote agent the first time; forgets
        the others idle for ``idle_s``. Raises InvalidHandle for an owner that does not answer
        or answers for another layout or agent."""
        now = time.monotonic()
        for pool_id, used in list(self._used.items()):
            if now - used > self._idle_s and pool_id != h.pool_id:
                self.forget(pool_id, "idle")
        peer = self._pools.get(h.pool_id)
        if peer is None:
            if not h.peer.startswith("tcp://"):
                raise InvalidHandle(f"KV handle names no NIXL metadata endpoint ({h.peer!r})")
            peer = request_pool(self._ctx, self._key, h.peer, h.pool_id, self._metadata_timeout_s)
            if peer.nbytes != peer.num_blocks * h.layout.block_bytes:
                raise InvalidHandle("KV owner's pool does not hold whole blocks of this layout")
            added = self._xfers.agent.add_remote_agent(peer.metadata)
            added = added.decode() if isinstance(added, bytes) else str(added)
            if added != peer.agent_name:
                raise InvalidHandle(f"KV owner's metadata names agent {added!r}")
            self._pools[h.pool_id] = peer
        self._used[h.pool_id] = now
        return peer

    def known(self, pool_id: bytes) -> PeerPool:
        """A pool reached before (KeyError if it was not, or was forgotten)."""
        return self._pools[pool_id]

    def forget(self, pool_id: bytes, why: str) -> None:
        """Drop a known pool and its remote agent; once its abandoned READs have settled, if
        some have not yet (``settle``)."""
        peer = self._pools.get(pool_id)
        self._to_forget.discard(pool_id)
        if peer is None:
            return
        if any(item.agent == peer.agent_name for item in self._abandoned):
            self._to_forget.add(pool_id)
            return
        del self._pools[pool_id]
        self._used.pop(pool_id, None)
        try:
            self._xfers.agent.remove_remote_agent(peer.agent_name)
        except Exception:  # nixl's binding errors share no base class beyond Exception
            log.warning("could not remove the NIXL agent %s", peer.agent_name, exc_info=True)
        log.info("forgot the KV owner %s (%s)", peer.agent_name, why)

    def abandon(self, xfer: Any, block_ids: list[int], peer: PeerPool) -> None:
        """Keep a READ that missed its deadline, and the blocks it writes, until it settles."""
        self._abandoned.append(_Abandoned(xfer, list(block_ids), peer.agent_name))

    def settle(self) -> list[int]:
        """The blocks of abandoned READs that have settled, free to reuse; forgets the pools
        whose READs failed or that wait to be forgotten."""
        held, failed, freed = [], set(), []
        for item in self._abandoned:
            state = self._xfers.state(item.xfer)
            if state == "PROC":
                held.append(item)
                continue
            if state != "DONE":
                failed.add(item.agent)
            self._xfers.release(item.xfer)
            freed += item.block_ids
        self._abandoned = held
        for pool_id, peer in list(self._pools.items()):
            if peer.agent_name in failed or pool_id in self._to_forget:
                self.forget(pool_id, "a READ from it failed")
        return freed

    def close(self) -> None:
        """Release every abandoned READ and remove every remote agent (the agent is closing)."""
        for item in self._abandoned:
            self._xfers.release(item.xfer)
        self._abandoned.clear()
        for peer in self._pools.values():
            self._xfers.agent.remove_remote_agent(peer.agent_name)
        self._pools.clear()
        self._used.clear()
        self._to_forget.clear()
