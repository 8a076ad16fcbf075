"""``PushedKV``: the engine's and the model's sides of a pushed request, over a stand-in transport
(the pushes themselves are tested in tests/transport/test_nixl_push.py)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from streamed_engine import decode_engine

from splitserve import SamplingParams
from splitserve.engine.build import build_components
from splitserve.engine.scheduler import LoadAgain
from splitserve.engine_config import EngineConfig
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

    def push_failed(self, target: bytes, why: str) -> BlocksStillWritten:
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


def test_a_push_tried_again_goes_into_other_blocks(puller):
    async def run() -> None:
        transport = Transport()
        source = PushedKV(transport, 20, 16, asyncio.get_running_loop())
        first = source.start([1, 2], puller)
        assert await source.target() == b"target-1"
        source.again("server down")  # its server may write on into blocks 1 and 2
        with pytest.raises(LoadAgain) as held:
            first.result(timeout=1)
        assert held.value.block_ids == [9] and transport.failed == [(b"target-1", "server down")]
        second = source.start([5, 6], puller)
        assert await source.target() == b"target-2"
        source.arrived()
        await asyncio.wrap_future(second)
        assert transport.arrived == [b"target-2"]

    asyncio.run(run())


def test_a_request_that_ends_while_its_push_waits_for_other_blocks_calls_nothing(puller):
    async def run() -> None:
        source = PushedKV(Transport(), 20, 16, asyncio.get_running_loop())
        source.start([1, 2], puller)
        await source.target()
        source.again("server down")
        source.discard()  # the engine ended it before reserving other blocks
        with pytest.raises(RequestEnded):
            await source.target()

    asyncio.run(run())


def test_the_engine_reserves_other_blocks_and_leaves_the_first_to_the_transport(puller):
    parts = build_components(EngineConfig(model="tiny", num_kv_blocks=64, max_model_len=128))
    engine = decode_engine(parts, puller)
    allocator = engine.scheduler.allocator

    class Holding(Transport):
        def push_failed(self, target: bytes, why: str) -> BlocksStillWritten:
            self.failed.append((target, why))
            return BlocksStillWritten(why, self.targets[-1][0])

    async def run() -> None:
        transport = Holding()
        source = PushedKV(transport, 40, 16, asyncio.get_running_loop())
        one = SamplingParams(max_tokens=1, temperature=0.0)
        engine.add_streaming("s", list(range(1, 41)), one, 0, source)
        engine.step()
        await source.target()
        source.again("server down")
        engine.step()  # the load ended with LoadAgain: other blocks, a new target
        assert await source.target() == b"target-2"
        first, second = transport.targets[0][0], transport.targets[1][0]
        assert not set(first) & set(second)
        source.arrived()
        engine.first_token("s", 7)  # its only token: the request ends once the KV is in
        deadline = time.monotonic() + 10
        while engine.has_unfinished() and time.monotonic() < deadline:
            engine.step()
            await asyncio.sleep(0.001)
        assert not engine.has_unfinished()
        assert allocator.num_used == len(first)  # the transport's until no WRITE can land

    asyncio.run(run())
