"""Pool ids and the files they name: one rule for every transport.

A pool id begins with its owner's pid namespace (the inode of ``/proc/self/ns/pid``) and pid,
u32 little-endian each; the rest is random. The owner's file in the transport's directory is
``splitserve-<pid namespace>-<owner pid>-<pool id hex>``, which ``cleanup.sweep_dead_owners``
recognizes. Pids repeat across pid namespaces (containers sharing ``/dev/shm`` or an IPC
namespace), so with the namespace in the name a sweeper never takes another container's live
pool for a dead owner's, and a reader in another pid namespace finds the file from the id alone.
"""

from __future__ import annotations

import os
import secrets
import struct
from pathlib import Path

from splitserve.kv.handle import ID_SIZE
from splitserve.transport import cleanup

OWNER = struct.Struct("<II")
"""The head of a pool id: pid namespace, pid."""


def new_pool_id() -> bytes:
    """A fresh pool id owned by this process."""
    owner = OWNER.pack(cleanup.pid_namespace(), os.getpid())
    return owner + secrets.token_bytes(ID_SIZE - OWNER.size)


def pool_owner(pool_id: bytes) -> tuple[int, int]:
    """The pid namespace and pid of the pool's owner."""
    namespace, pid = OWNER.unpack_from(pool_id)
    return namespace, pid


def owned_here(pool_id: bytes) -> bool:
    """Whether this process owns the pool."""
    return pool_owner(pool_id) == (cleanup.pid_namespace(), os.getpid())


def pool_path(directory: Path, pool_id: bytes) -> Path:
    """The file that the pool's owner makes in ``directory`` and its readers open."""
    namespace, pid = pool_owner(pool_id)
    return directory / cleanup.owned_name(pool_id.hex(), pid=pid, namespace=namespace)
