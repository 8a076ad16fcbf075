"""The cuda_ipc transport: what the CPU can check, then one process holding owner and reader."""

import os
import stat
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

from splitserve.kv.handle import InvalidHandle, decode_handle, encode_handle
from splitserve.kv.layout import KVLayout
from splitserve.kv.pool import KVPool
from splitserve.transport import cleanup, get_transport
from splitserve.transport.cuda_ipc import (
    IPC_HANDLE_SIZE,
    CudaIpcTransport,
    PoolInfo,
    _read_private,
    _write_private,
)
from splitserve.transport.key import generate_key

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
KEY = generate_key()
FAST = {"sweep_interval_s": 0.01}
CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (runs in scripts/gpu_check.sh)")


def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_module_loads_without_cuda_python_and_says_what_is_missing():
    code = (
        "import sys; sys.modules['cuda'] = None\n"
        "from splitserve.transport.cuda_ipc import runtime\n"
        "try:\n    runtime()\nexcept ImportError as exc:\n    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert "needs cuda-python" in out.stdout


def test_cpu_pools_are_refused_with_a_pointer_to_shm():
    with get_transport("cuda_ipc", key=KEY) as transport:
        assert isinstance(transport, CudaIpcTransport)
        with pytest.raises(ValueError, match="transport=shm"):
            transport.create_pool(LAYOUT, 4, "cpu")
        with pytest.raises(ValueError, match="transport=shm"):
            transport.register(KVPool(LAYOUT, 4))


def test_pool_info_round_trip_and_rejects():
    info = PoolInfo(bytes(range(16)), 4096, b"m" * IPC_HANDLE_SIZE, b"e" * IPC_HANDLE_SIZE)
    assert PoolInfo.decode(info.encode()) == info
    with pytest.raises(InvalidHandle, match="bytes"):
        PoolInfo.decode(info.encode()[:-1])
    with pytest.raises(InvalidHandle, match="magic"):
        PoolInfo.decode(b"XXXX" + info.encode()[4:])


def test_pool_info_file_must_be_private(tmp_path):
    info = PoolInfo(bytes(16), 64, bytes(IPC_HANDLE_SIZE), bytes(IPC_HANDLE_SIZE))
    path = tmp_path / "splitserve-1-ab"
    _write_private(path, info.encode())
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert _read_private(path)[0] == info
    with pytest.raises(FileExistsError):
        _write_private(path, info.encode())
    os.chmod(path, 0o640)
    with pytest.raises(InvalidHandle, match="private"):
        _read_private(path)
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(InvalidHandle, match="cannot open"):
        _read_private(link)


def test_ipc_handle_bytes_round_trip():
    rt = pytest.importorskip("cuda.bindings.runtime")
    from splitserve.transport.cuda_ipc import handle_bytes, handle_from_bytes

    data = bytes(range(IPC_HANDLE_SIZE))
    assert handle_bytes(handle_from_bytes(rt.cudaIpcMemHandle_t, data)) == data
    with pytest.raises(ValueError, match="64"):
        handle_from_bytes(rt.cudaIpcEventHandle_t, data[:8])


@pytest.fixture
def owner():
    transport = CudaIpcTransport(KEY, lease_ttl_s=10.0, read_margin_s=1.0, **FAST)
    pool = transport.create_pool(LAYOUT, 12, "cuda")
    transport.register(pool)
    pool.tensor.copy_(torch.randn(pool.tensor.shape, device="cuda"))
    yield transport, pool
    transport.close()


@pytest.fixture
def reader():
    transport = CudaIpcTransport(KEY, read_margin_s=1.0)
    pool = KVPool(LAYOUT, 10, "cuda")
    pool.tensor.fill_(-1.0)
    transport.register(pool)
    yield transport, pool
    transport.close()


@pytest.mark.gpu
@gpu
def test_fetch_copies_exact_blocks_and_release_frees(owner, reader):
    (own, src), (rd, dst) = owner, reader
    src.allocator.allocate(8)
    src.allocator.free([0, 4, 5])
    handle = own.export("req-1", [1, 2, 3, 6, 7], num_tokens=18)
    rd.fetch(handle, [9, 4, 5, 0, 1])
    assert torch.equal(dst.tensor[:, [9, 4, 5, 0, 1]], src.tensor[:, [1, 2, 3, 6, 7]])
    assert torch.all(dst.tensor[:, [2, 3, 6, 7, 8]] == -1)
    assert rd.stats()["fetches"] == 1 and rd.peer_pools() == 1
    rd.release(handle)
    wait_for(lambda: own.stats()["released"] == 1)
    assert src.allocator.num_free == 12 and own.stats()["pulled"] == 1


@pytest.mark.gpu
@gpu
def test_fetch_waits_for_kv_written_on_another_stream(owner, reader):
    (own, src), (rd, dst) = owner, reader
    ids = src.allocator.allocate(3)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        src.tensor[:, ids] = 7.0
        handle = own.export("late", ids, 12)
    rd.fetch(handle, [0, 1, 2])
    assert torch.all(dst.tensor[:, :3] == 7.0)


@pytest.mark.gpu
@gpu
def test_bad_handles_are_rejected_before_reading(owner, reader):
    (own, src), (rd, dst) = owner, reader
    handle = own.export("req", src.allocator.allocate(2), 8)
    h = decode_handle(handle, KEY)
    forged = bytearray(handle)
    forged[-40] ^= 0xFF
    bad = {
        "MAC": bytes(forged),
        "expired": encode_handle(replace(h, expiry=time.time() - 1), KEY),
        "transport": encode_handle(replace(h, transport="shm"), KEY),
    }
    for match, data in bad.items():
        with pytest.raises(InvalidHandle, match=match):
            rd.fetch(data, [0, 1])
    with pytest.raises(ValueError, match="range"):
        rd.fetch(handle, [0, 10])
    assert torch.all(dst.tensor == -1) and own.stats()["pulled"] == 0


@pytest.mark.gpu
@gpu
def test_info_file_is_private_and_a_closed_owner_is_gone(reader):
    rd, _ = reader
    own = CudaIpcTransport(KEY, **FAST)
    pool = own.create_pool(LAYOUT, 4, "cuda")
    own.register(pool)
    handle = own.export("req", pool.allocator.allocate(1), 1)
    path = own.info_path
    owner = f"splitserve-{cleanup.pid_namespace()}-{os.getpid()}-"
    assert path is not None and path.name.startswith(owner)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    rd.fetch(handle, [0])
    own.close()
    assert not path.exists()
    with pytest.raises(InvalidHandle, match="gone"):
        rd.fetch(handle, [1])
    assert rd.peer_pools() == 0
