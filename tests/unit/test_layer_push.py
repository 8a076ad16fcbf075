"""``PushedKV``: the engine's and the model's sides of a pushed request, over a stand-in transport
(the pushes themselves are tested in tests/transport/test_nixl_push.py)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from splitserve.kv.allocator import BlocksStillWritten
from splitserve.serving.layer_push import PushedKV, RequestEnded


class Transport:
    def __init__(self) -> None:
        self.targets: list[tuple[list[int], int]] = []
        self.arrived: list[bytes] = []
        self.failed: list[tuple[bytes, str]] = []

    def push_target(self, dst_block_ids: list[int], num_tokens: int) -> bytes:
        self.targets.append((list(dst_block_ids), num_tokens))
        return f"target-{len(self.targets)}".encode()

    def push_arrived(self, target: bytes) -> None:
        self.arrived.append(target)

    def push_failed(self, target: bytes, why: str) -> BaseException:
        self.failed.append((target, why))
        return BlocksStillWritten(why, [9])


@pytest.fixture
def puller():
    with ThreadPoolExecutor(1) as pool:
        yield pool


def test_the_target_names_the_reserved_blocks_and_the_reply_ends_the_load(puller):
    async def run() -> None:
        transport = Transport()
        source = PushedKV(transport, num_tokens=37, block_size=16, loop=asyncio.get_running_loop())
        done = await asyncio.to_thread(source.start, [4, 5], puller, 1)
        assert await source.target() == b"target-1"
        # One block cached here: the target holds the prompt's other 21 tokens.
        assert transport.targets == [([4, 5], 21)]
        assert not done.done()
        source.arrived()
        await asyncio.wrap_future(done)
        assert transport.arrived == [b"target-1"]
        source.failed("too late")  # after the KV is in: nothing to hold back
        assert transport.failed == []

    asyncio.run(run())


def test_every_block_cached_here_means_no_target(puller):
    async def run() -> None:
        transport = Transport()
        source = PushedKV(transport, num_tokens=32, block_size=16, loop=asyncio.get_running_loop())
        done = source.start([], puller, 2)
        assert await source.target() is None
        source.arrived()
        assert done.result(timeout=1) is None
        assert transport.targets == [] and transport.arrived == []

    asyncio.run(run())


def test_a_request_ended_before_its_blocks_were_reserved_calls_nothing():
    async def run() -> None:
        source = PushedKV(Transport(), 8, 16, asyncio.get_running_loop())
        source.discard()
        with pytest.raises(RequestEnded):
            await source.target()

    asyncio.run(run())


def test_a_push_that_failed_holds_its_blocks_back(puller):
    async def run() -> None:
        transport = Transport()
        source = PushedKV(transport, 20, 16, asyncio.get_running_loop())
        done = source.start([1, 2], puller)
        await source.target()
        source.cancel()  # the engine ended the request mid-push
        source.failed("the call failed")  # and the model saw the call end: once is enough
        with pytest.raises(BlocksStillWritten):
            done.result(timeout=1)
        assert transport.failed == [(b"target-1", "the request ended")]
        source.arrived()
        assert transport.arrived == []

    asyncio.run(run())
