"""Bookkeeping of KV pushes over NIXL: prefill WRITEs each layer of a prompt's KV into blocks
that decode allocated before it called prefill (``NixlTransport.push_target``).

Decode names its blocks in a push target: a ``KVHandle`` signed with the server start's key
whose pool is decode's own and whose ``peer`` is decode's metadata endpoint. Prefill WRITEs each
layer as soon as its pass wrote it, and answers only once every WRITE is done: a NIXL WRITE over
UCX is done once UCX flushed it to the target, so the answer itself says that the KV is in. No
announcement per layer goes through Triton and no READ request per layer crosses the link.

A push that failed, or whose caller went away, may leave WRITEs landing in decode's blocks. Decode
keeps those blocks out of its pool (quarantine) until prefill's ``settled`` notification names
the target (every WRITE of it finished or failed), or until no WRITE can come any more: prefill
posts none after the target's expiry and abandons its posted ones a transfer timeout later.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

SETTLED = b"SSPS"
"""Prefix of the notification prefill sends decode once a target's WRITEs all ended."""


def settled_message(lease_id: bytes) -> bytes:
    return SETTLED + lease_id


def settled_lease(message: bytes) -> bytes | None:
    """The lease id of a ``settled`` notification, None for any other message."""
    return message[len(SETTLED) :] if message.startswith(SETTLED) else None


@dataclass
class OutgoingPush:
    """Prefill's side of one target: where its WRITEs go and those posted so far."""

    target: Any
    """The checked ``KVHandle`` of the target."""
    agent: str
    """Decode's NIXL agent."""
    src_block_ids: list[int]
    """This pool's blocks whose layers go into the target's blocks, in order."""
    xfers: list[Any] = field(default_factory=list)
    failed: str | None = None
    """Why no further WRITE is posted (expired, a WRITE failed), if so."""


class IncomingPushes:
    """Decode's side: the targets it handed out and the blocks it holds back. Thread-safe (the
    model's event loop makes targets, the engine thread hears ``settled`` and frees)."""

    def __init__(self, transfer_timeout_s: float) -> None:
        self._transfer_timeout_s = transfer_timeout_s
        self._lock = threading.Lock()
        self._open: dict[bytes, list[int]] = {}
        """Targets whose prefill call has not ended, by lease id: their blocks."""
        self._quarantined: dict[bytes, tuple[list[int], float]] = {}
        """Targets whose push failed: their blocks and the wall time after which no WRITE of
        theirs can land."""
        self._settled: set[bytes] = set()
        self.counts = dict.fromkeys(("pushes", "push_failures", "quarantined_blocks"), 0)

    def opened(self, lease_id: bytes, block_ids: list[int]) -> None:
        with self._lock:
            self._open[lease_id] = list(block_ids)

    def arrived(self, lease_id: bytes) -> None:
        """Prefill answered: every WRITE into the target is done."""
        with self._lock:
            self._open.pop(lease_id, None)
            self._settled.discard(lease_id)
            self.counts["pushes"] += 1

    def failed(self, lease_id: bytes, expiry: float) -> list[int]:
        """The push failed: its blocks stay out of the pool until it settles; returns them."""
        with self._lock:
            blocks = self._open.pop(lease_id, [])
            self.counts["push_failures"] += 1
            if lease_id in self._settled:
                self._settled.discard(lease_id)
                self._quarantined[lease_id] = (blocks, 0.0)
            else:
                self._quarantined[lease_id] = (blocks, expiry + self._transfer_timeout_s + 1.0)
            return blocks

    def heard(self, message: bytes) -> None:
        """A notification from a prefill agent."""
        lease = settled_lease(message)
        if lease is None:
            return
        with self._lock:
            if lease in self._quarantined:
                self._quarantined[lease] = (self._quarantined[lease][0], 0.0)
            elif lease in self._open:
                self._settled.add(lease)

    def reap(self, now: float | None = None) -> list[int]:
        """Blocks of failed pushes that no WRITE can land in any more: theirs to free again."""
        now = time.time() if now is None else now
        free: list[int] = []
        with self._lock:
            for lease, (blocks, until) in list(self._quarantined.items()):
                if until <= now:
                    del self._quarantined[lease]
                    free += blocks
            self.counts["quarantined_blocks"] = sum(len(b) for b, _ in self._quarantined.values())
        return free
