"""One naming rule for the KV pools of both transports (``transport.pool_name``), and crash
recovery (``cleanup.sweep_dead_owners``) that recognizes the names it makes."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from splitserve.kv.handle import ID_SIZE, decode_handle
from splitserve.kv.layout import KVLayout
from splitserve.transport import cleanup, pool_name
from splitserve.transport.cuda_ipc import CudaIpcTransport
from splitserve.transport.key import generate_key
from splitserve.transport.leased import LeasedTransport
from splitserve.transport.shm import ShmTransport

KEY = generate_key()
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, dtype="float16")
NAMESPACE = cleanup.pid_namespace()


def pool_id_of(namespace: int, pid: int) -> bytes:
    return pool_name.OWNER.pack(namespace, pid) + secrets.token_bytes(ID_SIZE - 8)


def dead_pid() -> int:
    with subprocess.Popen([sys.executable, "-c", "pass"]) as proc:
        proc.wait()
    return proc.pid


def test_a_pool_id_names_its_owner_and_its_file(tmp_path: Path) -> None:
    pool_id = pool_name.new_pool_id()
    assert len(pool_id) == ID_SIZE and pool_name.new_pool_id() != pool_id
    assert pool_name.pool_owner(pool_id) == (NAMESPACE, os.getpid())
    assert pool_name.owned_here(pool_id)
    path = pool_name.pool_path(tmp_path, pool_id)
    assert path == tmp_path / f"splitserve-{NAMESPACE}-{os.getpid()}-{pool_id.hex()}"
    assert cleanup.OWNED_NAME.match(path.name)


def test_an_owner_in_another_pid_namespace_is_found_by_its_id(tmp_path: Path) -> None:
    """A reader computes the owner's file name, not one in its own namespace; the same pid in
    another namespace is another process."""
    foreign = pool_id_of(NAMESPACE + 1, os.getpid())
    path = pool_name.pool_path(tmp_path, foreign)
    assert path.name == f"splitserve-{NAMESPACE + 1}-{os.getpid()}-{foreign.hex()}"
    assert not pool_name.owned_here(foreign)


def exported_pool_id(transport: LeasedTransport, device: str) -> bytes:
    """Make the transport's own pool, and the id its handles carry."""
    pool = transport.create_pool(LAYOUT, 2, device)
    transport.register(pool)
    return decode_handle(transport.export("req", pool.allocator.allocate(1), 1), KEY).pool_id


def test_shm_names_its_segment_by_the_rule(tmp_path: Path) -> None:
    with ShmTransport(KEY, shm_dir=str(tmp_path)) as transport:
        pool_id = exported_pool_id(transport, "cpu")
        assert transport.segment_path == pool_name.pool_path(tmp_path, pool_id)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_ipc_names_its_info_file_by_the_rule(tmp_path: Path) -> None:
    with CudaIpcTransport(KEY, shm_dir=str(tmp_path)) as transport:
        pool_id = exported_pool_id(transport, "cuda")
        assert transport.info_path == pool_name.pool_path(tmp_path, pool_id)


def test_cleanup_sweeps_the_pools_of_dead_owners_of_its_namespace_only(tmp_path: Path) -> None:
    pid = dead_pid()
    live = pool_name.pool_path(tmp_path, pool_name.new_pool_id())
    dead = pool_name.pool_path(tmp_path, pool_id_of(NAMESPACE, pid))
    foreign = pool_name.pool_path(tmp_path, pool_id_of(NAMESPACE + 1, pid))
    for path in (live, dead, foreign):
        path.touch()
    assert cleanup.sweep_dead_owners(tmp_path) == [dead]
    assert live.exists() and foreign.exists()
