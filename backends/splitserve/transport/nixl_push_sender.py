"""Prefill's end of KV pushes over NIXL (``nixl_push``): the pushes under way, their WRITEs, the
targets already pushed into, and the pushes abandoned to settle. The transport checks a target
and says where its bytes are; this posts them and follows them to the end."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import numpy as np

from splitserve.kv.handle import InvalidHandle, KVHandle
from splitserve.transport.nixl_metadata import PeerPool
from splitserve.transport.nixl_push import OutgoingPush, settled_message
from splitserve.transport.nixl_xfers import Transfers

log = logging.getLogger(__name__)

COUNTS = (
    "pushed_bytes",
    "pushed_layers",
    "push_ns",
    "push_errors",
    "push_timeouts",
    "pushes_sent",
    "push_wait_ns",
)


class PushSender:
    def __init__(self, xfers: Transfers, transfer_timeout_s: float) -> None:
        self._xfers = xfers
        self._transfer_timeout_s = transfer_timeout_s
        self._outgoing: dict[bytes, OutgoingPush] = {}
        """Pushes under way, by target lease id."""
        self._abandoned: list[OutgoingPush] = []
        self._used_targets: OrderedDict[bytes, float] = OrderedDict()
        """Targets pushed into (lease id → expiry): a replayed one is refused."""
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(COUNTS, 0)

    def claim(self, target: KVHandle) -> None:
        """Take ``target`` for one push; InvalidHandle if it was taken before (a replay)."""
        now = time.time()
        with self._lock:
            while self._used_targets and next(iter(self._used_targets.values())) < now:
                self._used_targets.popitem(last=False)
            if target.lease_id in self._used_targets:
                raise InvalidHandle("KV push target already used (replayed target)")
            self._used_targets[target.lease_id] = target.expiry

    def open(self, target: KVHandle, agent: str, src_block_ids: list[int]) -> bytes:
        """A push of ``src_block_ids`` into ``target`` at ``agent``; returns its key."""
        with self._lock:
            self._outgoing[target.lease_id] = OutgoingPush(target, agent, src_block_ids)
        return target.lease_id

    def writable(self, key: bytes) -> OutgoingPush | None:
        """The push of ``key`` if WRITEs may still be posted to it (not failed, not expired)."""
        push = self._outgoing[key]
        if push.failed is None and time.time() >= push.target.expiry:
            push.failed = "the push target expired"
        return push if push.failed is None else None

    def write(
        self,
        push: OutgoingPush,
        local: np.ndarray,
        mem: str,
        remote: np.ndarray,
        peer: PeerPool,
        layers: int,
        started_ns: int,
    ) -> None:
        """Post one WRITE of ``layers`` layers from ``local`` to ``remote`` of ``peer``; a
        failure marks the push failed (``finish`` raises it)."""
        try:
            xfer = self._xfers.prepare("WRITE", local, mem, remote, peer)
        except Exception as exc:  # nixl's binding errors share no base class beyond Exception
            push.failed = f"could not post a KV WRITE: {exc}"
            return
        if self._xfers.state(xfer, post=True) == "ERR":
            self._xfers.release(xfer)
            push.failed = f"a KV WRITE to {peer.agent_name} failed"
        else:
            push.xfers.append(xfer)
        self.counts["pushed_bytes"] += int(local[:, 1].sum())
        self.counts["pushed_layers"] += layers
        self.counts["push_ns"] += time.perf_counter_ns() - started_ns

    def finish(self, key: bytes) -> None:
        """Wait until every WRITE of the push is done (the KV is in the target's blocks), then
        tell the target it settled. Raises if a WRITE failed, the target expired before the last
        layer, or the WRITEs missed the transfer timeout (then they are left to settle and the
        target hears of it when they have)."""
        with self._lock:
            push = self._outgoing.pop(key)
        started = time.perf_counter_ns()
        deadline = time.monotonic() + self._transfer_timeout_s
        running, failed = self._xfers.wait(list(push.xfers), deadline)
        if failed is not None and push.failed is None:
            push.failed = f"a KV WRITE to {push.agent} failed ({failed})"
        if running:
            self.counts["push_timeouts"] += 1
            push.xfers = running
            with self._lock:
                self._abandoned.append(push)
            raise RuntimeError(
                f"KV push to {push.agent} did not finish within {self._transfer_timeout_s:g} s"
            )
        self.counts["push_wait_ns"] += time.perf_counter_ns() - started
        self.counts["pushes_sent"] += 1
        self._settled(push)
        if push.failed is not None:
            self.counts["push_errors"] += 1
            raise RuntimeError(push.failed)

    def settle_abandoned(self) -> None:
        """Tell the targets of abandoned pushes whose WRITEs have all ended."""
        with self._lock:
            abandoned, self._abandoned = self._abandoned, []
        left = []
        for push in abandoned:
            push.xfers, _ = self._xfers.poll(push.xfers)
            if push.xfers:
                left.append(push)
            else:
                self._settled(push)
        with self._lock:
            self._abandoned += left

    def close(self) -> None:
        """Release every WRITE still held (the agent is about to go)."""
        for push in [*self._abandoned, *self._outgoing.values()]:
            for xfer in push.xfers:
                self._xfers.release(xfer)
        self._abandoned.clear()
        self._outgoing.clear()

    def _settled(self, push: OutgoingPush) -> None:
        try:
            self._xfers.agent.send_notif(push.agent, settled_message(push.target.lease_id))
        except Exception:  # the target may be gone; its blocks then wait for their expiry
            log.warning("could not tell %s that a KV push settled", push.agent, exc_info=True)
