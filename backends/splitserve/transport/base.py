"""The KV transport contract: how prefill lends KV blocks and decode pulls them.

One transport instance per model instance. The owner (prefill) allocates its pool with
``create_pool`` in memory the peers can open, ``register``s it, and turns the blocks of each
finished prompt into a handle with ``export``. The reader (decode) ``register``s its own pool,
``fetch``es a handle's blocks into blocks it allocated, then ``release``s the handle so the
owner frees them. Handles are opaque bytes signed with the key of the server start; every
method that takes one rejects a bad one with ``InvalidHandle`` before touching any memory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from splitserve.kv.layout import KVLayout
from splitserve.kv.pool import KVPool


class KVTransport(ABC):
    """Moves KV blocks between pools of different processes, by handle."""

    name: ClassVar[str]

    @abstractmethod
    def create_pool(self, layout: KVLayout, num_blocks: int, device: torch.device | str) -> KVPool:
        """Allocate a pool in memory that readers of this transport can open.

        Only such a pool can be exported from. Its allocator is thread-safe, because leases
        are freed on the transport's release thread.
        """

    @abstractmethod
    def register(self, pool: KVPool) -> None:
        """Make ``pool`` this instance's local pool: the source of ``export`` and the
        destination of ``fetch``. A pool from ``create_pool`` also becomes openable by
        peers, and the instance starts serving release messages for it."""

    @abstractmethod
    def export(
        self, req_id: str, block_ids: list[int], num_tokens: int, *, streamed: bool = False
    ) -> bytes:
        """Lease ``block_ids`` (holding ``num_tokens`` tokens) of the registered pool and
        return their handle.

        The caller hands the blocks over: they return to the pool's allocator exactly once,
        when the reader releases the handle or the lease expires. ``streamed``: the blocks are
        still being written (a prompt pass exports before it runs); the caller announces each
        layer with ``publish_layers`` once written, and readers fetch only announced layers.
        """

    @abstractmethod
    def publish_layers(self, block_ids: list[int], layers: range) -> None:
        """``layers`` of exported ``block_ids`` are written: prepare them for readers (encode
        them, where the transport's encoding is not raw)."""

    @abstractmethod
    def fetch(self, handle: bytes, dst_block_ids: list[int], skip: int = 0) -> None:
        """Copy the handle's blocks, in order, into ``dst_block_ids`` of the registered pool;
        all but the first ``skip`` (the reader holds those already: cached).

        Raises ``InvalidHandle`` (nothing read) for a forged, altered, foreign, expired,
        nearly expired or already released handle, and ``ValueError`` (nothing read) when the
        handle's layout differs from the local pool's or the destination ids do not fit.
        Returns once the copy is complete; the caller then calls ``release``.
        """

    @abstractmethod
    def fetch_layers(
        self, handle: bytes, dst_block_ids: list[int], layers: range, skip: int = 0
    ) -> None:
        """``fetch`` of ``layers`` only (a step-1 range of the layout's layers): how a reader
        pulls a streamed handle's layers as they are announced."""

    @abstractmethod
    def release(self, handle: bytes) -> None:
        """Tell the owner it may free the handle's blocks. Idempotent; never blocks on the
        owner. Also the way to drop a handle that will not be fetched (a cancelled request)."""

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Counters for metrics: leases outstanding, granted, released, expired, rejected
        messages; on the reading side ``fetches``, ``fetched_bytes`` (as moved: encoded where
        the handle says so), ``fetched_fp8_bytes`` (of those, fp8-encoded) and ``fetch_ns``."""

    @abstractmethod
    def close(self) -> None:
        """Stop serving releases and unmap, unlink and close everything this instance made.
        Idempotent. Blocks of a closed owner's pool must not be read any more."""

    def __enter__(self) -> KVTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
