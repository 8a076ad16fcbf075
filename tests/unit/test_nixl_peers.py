"""The NIXL reader's table of owner pools: which pools it forgets when, and that a READ it
abandoned keeps its blocks and its owner's agent until the READ settles. NIXL's agent and the
metadata request are stood in for; the real ones: tests/transport/test_nixl*.py."""

import time
from typing import Any

import pytest
import zmq

from splitserve.kv.handle import KVHandle
from splitserve.kv.layout import KVLayout
from splitserve.transport import nixl_peers
from splitserve.transport.nixl_metadata import PeerPool
from splitserve.transport.nixl_peers import Peers
from splitserve.transport.nixl_xfers import Transfers

IDLE_S = 0.05
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=4, dtype="float32")


class Agent:
    def __init__(self) -> None:
        self.remote: set[str] = set()
        self.states: dict[str, str] = {}
        self.released: list[str] = []

    def add_remote_agent(self, metadata: bytes) -> bytes:
        self.remote.add(metadata.decode())
        return metadata

    def remove_remote_agent(self, name: str) -> None:
        self.remote.remove(name)

    def check_xfer_state(self, xfer: str) -> str:
        return self.states[xfer]

    def release_xfer_handle(self, xfer: str) -> None:
        self.released.append(xfer)


def handle(pool: int) -> KVHandle:
    return KVHandle(
        owner="o",
        pool_id=bytes([pool]) * 16,
        transport="nixl",
        layout=LAYOUT,
        lease_id=bytes(16),
        block_ids=(0,),
        num_tokens=1,
        expiry=0.0,
        peer=f"tcp://10.0.0.{pool}:1",
    )


@pytest.fixture
def table(monkeypatch: pytest.MonkeyPatch) -> Any:
    def request_pool(ctx: Any, key: bytes, endpoint: str, pool_id: bytes, timeout_s: float):
        name = f"agent-{pool_id[0]}"
        return PeerPool(name, 0, 8 * LAYOUT.block_bytes, 0, "DRAM", 8, name.encode())

    monkeypatch.setattr(nixl_peers, "request_pool", request_pool)
    agent, ctx = Agent(), zmq.Context()
    yield Peers(Transfers(agent), ctx, b"k" * 32, 1.0, idle_s=IDLE_S), agent
    ctx.term()


def test_a_pool_is_asked_for_once_and_forgotten_when_idle(table):
    peers, agent = table
    assert peers.reach(handle(1)) is peers.reach(handle(1))
    time.sleep(2 * IDLE_S)
    peers.reach(handle(2))
    assert len(peers) == 1 and agent.remote == {"agent-2"}
    with pytest.raises(KeyError):
        peers.known(handle(1).pool_id)


def test_an_abandoned_read_keeps_its_blocks_and_its_owner_until_it_settles(table):
    peers, agent = table
    peer = peers.reach(handle(1))
    agent.states["x"] = "PROC"
    peers.abandon("x", [3, 4], peer)
    peers.forget(handle(1).pool_id, "a READ from it failed")
    assert agent.remote == {"agent-1"} and peers.held_blocks == 2
    assert peers.settle() == [] and agent.released == []
    agent.states["x"] = "DONE"
    assert peers.settle() == [3, 4]
    assert agent.released == ["x"] and peers.held_blocks == 0
    assert agent.remote == set() and len(peers) == 0  # forgotten once it settled


def test_a_read_that_settles_failed_forgets_its_owner(table):
    peers, agent = table
    peers.abandon("x", [5], peers.reach(handle(1)))
    peers.reach(handle(2))
    agent.states["x"] = "ERR"
    assert peers.settle() == [5]
    assert agent.remote == {"agent-2"}


def test_close_releases_reads_and_agents(table):
    peers, agent = table
    agent.states["x"] = "PROC"
    peers.abandon("x", [1], peers.reach(handle(1)))
    peers.close()
    assert agent.released == ["x"] and agent.remote == set() and len(peers) == 0
