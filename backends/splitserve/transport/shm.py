"""KV transport over POSIX shared memory, for processes on one machine without GPUs.

The owner's pool lives in ``<shm_dir>/splitserve-<pid namespace>-<owner pid>-<pool id hex>``
(``pool_name``'s rule; mode 0600, unlinked on close and at exit; a SIGKILLed owner's is swept by
the next pool created on the machine and by the launcher, see ``cleanup``), allocated up front
so that a full tmpfs fails at creation, not with SIGBUS on a later write. A reader maps the
segment read-only once per pool id and copies blocks out of it; it checks on every fetch that
the segment it mapped is still the owner's.
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from splitserve.kv.handle import InvalidHandle, KVHandle
from splitserve.kv.layout import KVLayout
from splitserve.kv.lease import LockedAllocator
from splitserve.kv.pool import KVPool
from splitserve.transport import cleanup, pool_name
from splitserve.transport.leased import MappedTransport

log = logging.getLogger(__name__)


@dataclass
class _Segment:
    pool_id: bytes
    path: Path
    pool: KVPool


@dataclass
class _Peer:
    tensor: torch.Tensor
    layout: KVLayout
    inode: int


class ShmTransport(MappedTransport):
    """``KVTransport`` whose pools are shared-memory segments; CPU pools only."""

    name = "shm"

    def __init__(self, key: bytes, *, shm_dir: str = "/dev/shm", **options: Any) -> None:
        super().__init__(key, **options)
        self._shm_dir = Path(shm_dir)
        self._segment: _Segment | None = None
        self._peers: dict[bytes, _Peer] = {}

    def create_pool(
        self, layout: KVLayout, num_blocks: int, device: torch.device | str = "cpu"
    ) -> KVPool:
        if torch.device(device).type != "cpu":
            raise ValueError(f"the shm transport holds CPU pools only, not {device}")
        if self._segment is not None:
            raise RuntimeError("this transport already created its pool")
        for stale in cleanup.sweep_dead_owners(self._shm_dir):
            log.warning("removed %s, left by a process that was killed", stale)
        pool_id = pool_name.new_pool_id()
        path = pool_name.pool_path(self._shm_dir, pool_id)
        size = num_blocks * layout.block_bytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        cleanup.track(path)
        try:
            os.posix_fallocate(fd, 0, size)
            buffer = mmap.mmap(fd, size)
        except BaseException as exc:
            path.unlink()
            cleanup.untrack(path)
            if isinstance(exc, OSError):
                raise OSError(
                    exc.errno,
                    f"cannot place a {size}-byte KV pool in {self._shm_dir} "
                    "(in Docker raise --shm-size)",
                ) from exc
            raise
        finally:
            os.close(fd)
        storage = torch.frombuffer(buffer, dtype=torch.uint8)
        pool = KVPool(layout, num_blocks, "cpu", storage, LockedAllocator(num_blocks))
        self._segment = _Segment(pool_id, path, pool)
        return pool

    @property
    def segment_path(self) -> Path | None:
        """Where this instance's own pool lives, once ``create_pool`` ran."""
        return self._segment.path if self._segment is not None else None

    def peer_pools(self) -> int:
        """How many owners' segments this instance has mapped."""
        return len(self._peers)

    def _exported_pool_id(self, pool: KVPool) -> bytes | None:
        if self._segment is not None and self._segment.pool is pool:
            return self._segment.pool_id
        return None

    def _open(self, handle: KVHandle) -> torch.Tensor:
        if self._segment is not None and handle.pool_id == self._segment.pool_id:
            return self._segment.pool.tensor
        path = pool_name.pool_path(self._shm_dir, handle.pool_id)
        peer = self._peers.get(handle.pool_id)
        try:
            inode = os.stat(path).st_ino
        except FileNotFoundError:
            self._peers.pop(handle.pool_id, None)
            raise InvalidHandle(f"KV pool {handle.pool_id.hex()} is gone (owner closed)") from None
        if peer is None or peer.inode != inode:
            peer = self._map(path, handle.layout)
            self._peers[handle.pool_id] = peer
        if peer.layout != handle.layout:
            raise InvalidHandle("KV handle layout differs from its pool's")
        return peer.tensor

    def _map(self, path: Path, layout: KVLayout) -> _Peer:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise InvalidHandle(f"cannot open KV pool segment {path}: {exc}") from None
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
                raise InvalidHandle(f"KV pool segment {path} is not private to this user")
            if st.st_size == 0 or st.st_size % layout.block_bytes:
                raise InvalidHandle(f"KV pool segment {path} does not hold whole blocks")
            buffer = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given buffer is not writable")
            raw = torch.frombuffer(buffer, dtype=torch.uint8)
        shape = layout.pool_shape(st.st_size // layout.block_bytes)
        return _Peer(raw.view(layout.torch_dtype).view(shape), layout, st.st_ino)

    def _close_memory(self) -> None:
        self._peers.clear()
        if self._segment is not None:
            self._segment.path.unlink(missing_ok=True)
            cleanup.untrack(self._segment.path)
