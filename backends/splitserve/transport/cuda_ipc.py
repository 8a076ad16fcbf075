"""KV transport over CUDA IPC, for prefill and decode processes on the GPUs of one machine.

The owner's pool is one plain ``cudaMalloc`` allocation (IPC cannot export memory of the
caching allocator's expandable segments), exported once with ``cudaIpcGetMemHandle`` beside an
interprocess event that ``export`` records on the current stream, after prefill's KV writes.
Both handles, the GPU's UUID and the pool size go into a 0600 file
``<shm_dir>/splitserve-<pid namespace>-<owner pid>-<pool id hex>`` (``pool_name``'s rule, as
the shm transport's segments; unlinked on close, at exit and on SIGTERM; a SIGKILLed owner's is
swept like theirs, see ``cleanup``).

The signed KV handle names only the pool id: a reader opens the file, maps the memory and the
event once per pool id, and on every fetch checks that the file is still the owner's, waits on
the event on a stream of its own, copies one slice (a ``cudaMemcpyAsync``) per contiguous run
of block ids and synchronizes that stream before the caller releases the lease. A reader on
another GPU needs peer access to the owner's GPU and says so when it is missing. The owner's
memory is freed with the last tensor over it; readers close their mappings in ``close``, which
must come first (freeing memory that another process still maps is undefined in CUDA).

CUDA refuses to open a process's own IPC handles, so a reader in the owner's process (both
roles in one process, tests) uses the owner's pointer and event directly.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import stat
import struct
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from splitserve.kv.handle import InvalidHandle, KVHandle
from splitserve.kv.layout import KVLayout
from splitserve.kv.lease import LockedAllocator
from splitserve.kv.pool import KVPool
from splitserve.transport import cleanup, pool_name
from splitserve.transport.leased import MappedTransport

log = logging.getLogger(__name__)

IPC_HANDLE_SIZE = 64
_INFO = struct.Struct("<4sH16sQ64s64s")
_INFO_MAGIC = b"SSCI"
_INFO_VERSION = 1


class CudaError(RuntimeError):
    """A CUDA runtime call failed."""


class PeerAccessError(RuntimeError):
    """The reader's GPU cannot map the owner's GPU memory."""


def runtime() -> ModuleType:
    """cuda-python's runtime bindings: ``cuda.bindings.runtime``, or ``cuda.cudart`` before 12.6."""
    try:
        from cuda.bindings import runtime as rt
    except ImportError:
        try:
            from cuda import cudart as rt
        except ImportError:
            raise ImportError(
                "the cuda_ipc transport needs cuda-python (pip install 'splitserve[gpu]')"
            ) from None
    return rt


def call(name: str, *args: Any) -> Any:
    """``cuda<name>(*args)``; raises CudaError on failure, returns the value(s) it yields."""
    rt = runtime()
    err, *values = getattr(rt, f"cuda{name}")(*args)
    if err != rt.cudaError_t.cudaSuccess:
        _, text = rt.cudaGetErrorString(err)
        raise CudaError(f"cuda{name} failed: {err.name} ({text.decode(errors='replace')})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


@contextlib.contextmanager
def on_device(index: int) -> Iterator[None]:
    """Make ``index`` the calling thread's current device for the runtime calls inside."""
    previous = call("GetDevice")
    if previous == index:
        yield
        return
    call("SetDevice", index)
    try:
        yield
    finally:
        call("SetDevice", previous)


def handle_bytes(handle: Any) -> bytes:
    """The 64 bytes of a ``cudaIpcMemHandle_t`` or ``cudaIpcEventHandle_t``."""
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_SIZE)


def handle_from_bytes(cls: type, data: bytes) -> Any:
    if len(data) != IPC_HANDLE_SIZE:
        raise ValueError(f"an IPC handle is {IPC_HANDLE_SIZE} bytes, got {len(data)}")
    handle = cls()
    ctypes.memmove(handle.getPtr(), data, IPC_HANDLE_SIZE)
    return handle


def device_uuid(index: int) -> bytes:
    return bytes(call("GetDeviceProperties", index).uuid.bytes)


def device_with_uuid(uuid: bytes) -> int:
    """The visible device ordinal of the GPU with ``uuid``."""
    for index in range(call("GetDeviceCount")):
        if device_uuid(index) == uuid:
            return index
    raise PeerAccessError(
        f"the KV pool's GPU (uuid {uuid.hex()}) is not visible to this process; "
        "check CUDA_VISIBLE_DEVICES of both instances"
    )


def check_peer_access(reader: int, owner: int) -> None:
    """Raise PeerAccessError unless GPU ``reader`` can map memory of GPU ``owner``."""
    if reader != owner and not call("DeviceCanAccessPeer", reader, owner):
        raise PeerAccessError(
            f"GPU {reader} cannot access GPU {owner}'s memory (no peer access between them): "
            "run prefill and decode on one GPU or on GPUs with NVLink or PCIe peer access"
        )


@dataclass(frozen=True)
class PoolInfo:
    """What a reader needs to open an owner's pool; the content of the ``.cudaipc`` file."""

    device_uuid: bytes
    nbytes: int
    mem_handle: bytes
    event_handle: bytes

    def encode(self) -> bytes:
        return _INFO.pack(
            _INFO_MAGIC,
            _INFO_VERSION,
            self.device_uuid,
            self.nbytes,
            self.mem_handle,
            self.event_handle,
        )

    @classmethod
    def decode(cls, data: bytes) -> PoolInfo:
        if len(data) != _INFO.size:
            raise InvalidHandle(f"KV pool info has {len(data)} bytes, expected {_INFO.size}")
        magic, version, uuid, nbytes, mem, event = _INFO.unpack(data)
        if magic != _INFO_MAGIC or version != _INFO_VERSION:
            raise InvalidHandle("KV pool info has a bad magic or version")
        return cls(uuid, nbytes, mem, event)


class _DeviceBuffer:
    """A device allocation seen by torch through ``__cuda_array_interface__``; frees itself
    (``cudaFree``) with the last tensor over it when ``owned``."""

    def __init__(self, ptr: int, nbytes: int, *, owned: bool) -> None:
        self.ptr, self.nbytes, self.owned = ptr, nbytes, owned

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 2}

    def raw(self) -> torch.Tensor:
        """The bytes as a uint8 CUDA tensor that keeps this buffer alive."""
        tensor = torch.as_tensor(self)
        if tensor.data_ptr() != self.ptr:
            raise CudaError("torch copied the device buffer instead of wrapping it")
        return tensor

    def pool_view(self, layout: KVLayout) -> torch.Tensor:
        shape = layout.pool_shape(self.nbytes // layout.block_bytes)
        return self.raw().view(layout.torch_dtype).view(shape)

    def __del__(self) -> None:
        if self.owned:
            runtime().cudaFree(self.ptr)


@dataclass
class _Export:
    pool_id: bytes
    path: Path
    pool: KVPool
    device: int
    event: Any


@dataclass
class _Peer:
    ptr: int
    tensor: torch.Tensor
    event: Any
    layout: KVLayout
    inode: int
    imported: bool


_LOCAL_EXPORTS: weakref.WeakValueDictionary[bytes, _Export] = weakref.WeakValueDictionary()
"""Pools exported by this process, by pool id: CUDA cannot open a process's own IPC handles."""


class CudaIpcTransport(MappedTransport):
    """``KVTransport`` whose pools are CUDA allocations shared through CUDA IPC."""

    name = "cuda_ipc"

    def __init__(self, key: bytes, *, shm_dir: str = "/dev/shm", **options: Any) -> None:
        super().__init__(key, **options)
        self._shm_dir = Path(shm_dir)
        self._export: _Export | None = None
        self._peers: dict[bytes, _Peer] = {}
        self._stream: torch.cuda.Stream | None = None

    def create_pool(
        self, layout: KVLayout, num_blocks: int, device: torch.device | str = "cuda"
    ) -> KVPool:
        index = _cuda_index(device)
        if self._export is not None:
            raise RuntimeError("this transport already created its pool")
        nbytes = num_blocks * layout.block_bytes
        rt = runtime()
        for stale in cleanup.sweep_dead_owners(self._shm_dir):
            log.warning("removed %s, left by a process that was killed", stale)
        pool_id = pool_name.new_pool_id()
        path = pool_name.pool_path(self._shm_dir, pool_id)
        with on_device(index):
            try:
                ptr = int(call("Malloc", nbytes))
            except CudaError as exc:
                raise CudaError(
                    f"cannot allocate a {nbytes}-byte KV pool on GPU {index}: {exc}"
                ) from None
            buffer = _DeviceBuffer(ptr, nbytes, owned=True)
            call("Memset", ptr, 0, nbytes)
            event = call(
                "EventCreateWithFlags", rt.cudaEventDisableTiming | rt.cudaEventInterprocess
            )
            try:
                info = PoolInfo(
                    device_uuid=device_uuid(index),
                    nbytes=nbytes,
                    mem_handle=handle_bytes(call("IpcGetMemHandle", ptr)),
                    event_handle=handle_bytes(call("IpcGetEventHandle", event)),
                )
                _write_private(path, info.encode())
            except BaseException:
                rt.cudaEventDestroy(event)
                raise
        cleanup.track(path)
        storage = buffer.raw()
        pool = KVPool(layout, num_blocks, storage.device, storage, LockedAllocator(num_blocks))
        self._export = _Export(pool_id, path, pool, index, event)
        _LOCAL_EXPORTS[pool_id] = self._export
        return pool

    @property
    def info_path(self) -> Path | None:
        """The file peers open this instance's pool by, once ``create_pool`` ran."""
        return self._export.path if self._export is not None else None

    def peer_pools(self) -> int:
        """How many owners' pools this instance has opened."""
        return len(self._peers)

    def register(self, pool: KVPool) -> None:
        if pool.device.type != "cuda":
            raise ValueError(
                f"the cuda_ipc transport moves KV between CUDA pools, not {pool.device} "
                "(use transport=shm for CPU pools)"
            )
        super().register(pool)

    def export(
        self, req_id: str, block_ids: list[int], num_tokens: int, *, streamed: bool = False
    ) -> bytes:
        if streamed:
            # Readers wait for the one event recorded here: it cannot cover later layers.
            raise ValueError("the cuda_ipc transport does not stream layers")
        if self._export is not None and self._pool is self._export.pool:
            stream = torch.cuda.current_stream(self._export.device)
            with on_device(self._export.device):
                call("EventRecord", self._export.event, stream.cuda_stream)
        return super().export(req_id, block_ids, num_tokens)

    def fetch_layers(
        self, handle: bytes, dst_block_ids: list[int], layers: range, skip: int = 0
    ) -> None:
        """The base class checks the handle and copies one strided slice per contiguous run; here
        those copies go to a stream of this transport's that first waits for the local compute
        stream and (in ``_open``) for the owner's event, and is synchronized before returning."""
        if self._pool is None:
            raise RuntimeError("fetch needs a registered pool")
        device = self._pool.device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._stream):
            super().fetch_layers(handle, dst_block_ids, layers, skip)
        self._stream.synchronize()

    def _exported_pool_id(self, pool: KVPool) -> bytes | None:
        if self._export is not None and self._export.pool is pool:
            return self._export.pool_id
        return None

    def _open(self, handle: KVHandle) -> torch.Tensor:
        own = self._export
        if own is not None and handle.pool_id == own.pool_id:
            self._wait(own.event)
            return own.pool.tensor
        path = pool_name.pool_path(self._shm_dir, handle.pool_id)
        peer = self._peers.get(handle.pool_id)
        try:
            inode = os.stat(path).st_ino
        except FileNotFoundError:
            if peer is not None:
                self._close_peer(self._peers.pop(handle.pool_id))
            raise InvalidHandle(f"KV pool {handle.pool_id.hex()} is gone (owner closed)") from None
        if peer is None or peer.inode != inode:
            if peer is not None:
                self._close_peer(self._peers.pop(handle.pool_id))
            peer = self._map(handle, path)
            self._peers[handle.pool_id] = peer
        if peer.layout != handle.layout:
            raise InvalidHandle("KV handle layout differs from its pool's")
        self._wait(peer.event)
        return peer.tensor

    def _wait(self, event: Any) -> None:
        """Order the current stream after the owner's last recorded KV writes."""
        assert self._pool is not None
        stream = torch.cuda.current_stream(self._pool.device)
        with on_device(_cuda_index(self._pool.device)):
            call("StreamWaitEvent", stream.cuda_stream, event, 0)

    def _map(self, handle: KVHandle, path: Path) -> _Peer:
        info, inode = _read_private(path)
        layout = handle.layout
        if info.nbytes == 0 or info.nbytes % layout.block_bytes:
            raise InvalidHandle(f"KV pool {path} does not hold whole blocks")
        if pool_name.owned_here(handle.pool_id):
            export = _LOCAL_EXPORTS.get(handle.pool_id)
            if export is None:
                raise InvalidHandle(f"KV pool {handle.pool_id.hex()} is gone (owner closed)")
            return _Peer(
                export.pool.tensor.data_ptr(),
                export.pool.tensor,
                export.event,
                layout,
                inode,
                imported=False,
            )
        assert self._pool is not None
        local = _cuda_index(self._pool.device)
        rt = runtime()
        with on_device(local):
            check_peer_access(local, device_with_uuid(info.device_uuid))
            mem = handle_from_bytes(rt.cudaIpcMemHandle_t, info.mem_handle)
            ptr = int(call("IpcOpenMemHandle", mem, rt.cudaIpcMemLazyEnablePeerAccess))
            try:
                event = call(
                    "IpcOpenEventHandle",
                    handle_from_bytes(rt.cudaIpcEventHandle_t, info.event_handle),
                )
            except CudaError:
                call("IpcCloseMemHandle", ptr)
                raise
        tensor = _DeviceBuffer(ptr, info.nbytes, owned=False).pool_view(layout)
        return _Peer(ptr, tensor, event, layout, inode, imported=True)

    def _close_peer(self, peer: _Peer) -> None:
        if peer.imported:
            rt = runtime()
            rt.cudaEventDestroy(peer.event)
            rt.cudaIpcCloseMemHandle(peer.ptr)

    def _close_memory(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        for peer in self._peers.values():
            self._close_peer(peer)
        self._peers.clear()
        own = self._export
        if own is not None:
            own.path.unlink(missing_ok=True)
            cleanup.untrack(own.path)
            _LOCAL_EXPORTS.pop(own.pool_id, None)
            runtime().cudaEventDestroy(own.event)


def _cuda_index(device: torch.device | str) -> int:
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(
            f"the cuda_ipc transport holds CUDA pools only, not {dev} "
            "(use transport=shm for CPU pools)"
        )
    return dev.index if dev.index is not None else torch.cuda.current_device()


def _write_private(path: Path, data: bytes) -> None:
    """Create ``path`` (mode 0600) holding ``data``, never over an existing file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _read_private(path: Path) -> tuple[PoolInfo, int]:
    """The pool info in ``path`` and its inode; rejects files other users could have written."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise InvalidHandle(f"cannot open KV pool info {path}: {exc}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise InvalidHandle(f"KV pool info {path} is not private to this user")
        return PoolInfo.decode(f.read(_INFO.size + 1)), st.st_ino
