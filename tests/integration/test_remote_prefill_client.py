"""``RemotePrefillClient`` against real tritonservers serving a toy ``prefill`` model with the
real model's inputs and outputs: a call, the auth parameter, pool full, failover from a
stopped server and its return, and cancellation that reaches the server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from splitserve.deploy.launcher import TritonServer, free_port
from splitserve.serving import bls_contract
from splitserve.serving.prefill_client import PrefillCall, PrefillFailed
from splitserve.serving.prefill_discovery import StaticDiscovery
from splitserve.serving.prefill_router import PrefillRouter
from splitserve.serving.remote_prefill import RemotePrefillClient

pytestmark = pytest.mark.triton

ServerFactory = Callable[[Path], TritonServer]
START_TIMEOUT_S = 60.0
POOL_FULL_PROMPT = [666]
BAD_PROMPT = [555]
SLOW_PROMPT = [777]
"""Runs until the request is cancelled (at most 10 s), then leaves the file ``cancelled``."""

CONFIG = """
name: "prefill"
backend: "python"
max_batch_size: 8
input [
  { name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ] allow_ragged_batch: true },
  { name: "sampling_parameters" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "seed" data_type: TYPE_UINT64 dims: [ 1 ] },
  { name: "request_id" data_type: TYPE_STRING dims: [ 1 ] }
]
output [
  { name: "first_token" data_type: TYPE_INT64 dims: [ 1 ] },
  { name: "kv_handle" data_type: TYPE_UINT8 dims: [ -1 ] }
]
instance_group [ { count: 2 kind: KIND_CPU } ]
"""

# first_token = len(input_ids); kv_handle = b"h" + request_id; auth must be "tag-" + request_id.
MODEL = """
import json
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

POOL_FULL = {pool_full!r}
MARKER = Path({marker!r})


def fail(message, code):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


class TritonPythonModel:
    def execute(self, requests):
        return [self.one(request) for request in requests]

    def one(self, request):
        def get(name):
            return pb_utils.get_input_tensor_by_name(request, name).as_numpy()

        ids = get("input_ids").reshape(-1).tolist()
        rid = get("request_id").reshape(-1)[0].decode()
        json.loads(get("sampling_parameters").reshape(-1)[0])
        if json.loads(request.parameters()).get("splitserve_auth") != "tag-" + rid:
            return fail("bad auth", pb_utils.TritonError.INVALID_ARG)
        if ids == {pool_full_prompt!r}:
            return fail(POOL_FULL + ": needs 9 blocks, 0 free", pb_utils.TritonError.UNAVAILABLE)
        if ids == {bad_prompt!r}:
            return fail("bad prompt", pb_utils.TritonError.INVALID_ARG)
        if ids == {slow_prompt!r}:
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline:
                if request.is_cancelled():
                    MARKER.write_text(rid)
                    return fail("cancelled", pb_utils.TritonError.CANCELLED)
                time.sleep(0.01)
        first = np.array([[len(ids)]], dtype=np.int64)
        handle = np.frombuffer(b"h" + rid.encode(), dtype=np.uint8).reshape(1, -1)
        outputs = [pb_utils.Tensor("first_token", first), pb_utils.Tensor("kv_handle", handle)]
        return pb_utils.InferenceResponse(output_tensors=outputs)
"""


def call(rid: str, prompt: list[int] | None = None) -> PrefillCall:
    return PrefillCall(
        prompt_ids=[1, 2, 3] if prompt is None else prompt,
        params_json=b'{"temperature": 0.0}',
        seed=7,
        request_id=rid,
        auth=f"tag-{rid}",
    )


@pytest.fixture(scope="module")
def prefill_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("remote_prefill_repo")
    (repo / "prefill" / "1").mkdir(parents=True)
    (repo / "prefill" / "config.pbtxt").write_text(CONFIG)
    model = MODEL.format(
        pool_full=bls_contract.POOL_FULL,
        marker=str(repo / "cancelled"),
        pool_full_prompt=POOL_FULL_PROMPT,
        bad_prompt=BAD_PROMPT,
        slow_prompt=SLOW_PROMPT,
    )
    (repo / "prefill" / "1" / "model.py").write_text(model)
    return repo


@pytest.fixture(scope="module")
def servers(make_triton_server: ServerFactory, prefill_repo: Path) -> Iterator[list[TritonServer]]:
    """Two servers of the toy repository, started; a test may stop and restart the second."""
    started = [make_triton_server(prefill_repo) for _ in range(2)]
    try:
        for server in started:
            server.start(START_TIMEOUT_S)
        yield started
    finally:
        for server in started:
            server.stop()


def client_of(*urls: str, backoff_start_s: float = 1.0) -> RemotePrefillClient:
    router = PrefillRouter(backoff_start_s=backoff_start_s)
    return RemotePrefillClient(StaticDiscovery(urls), router=router, call_timeout_s=20.0)


async def wait_until(check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_call_pool_full_and_bad_request(servers: list[TritonServer]) -> None:
    url = servers[0].grpc_url

    async def run() -> None:
        client = client_of(url)
        try:
            reply = await client.prefill(call("r1", [5, 6, 7, 8]))
            assert (reply.first_token, reply.kv_handle, reply.server) == (4, b"hr1", url)

            with pytest.raises(PrefillFailed) as full:
                await client.prefill(call("r2", POOL_FULL_PROMPT))
            assert full.value.pool_full and not full.value.retryable
            assert bls_contract.POOL_FULL in str(full.value)

            with pytest.raises(PrefillFailed) as bad:
                await client.prefill(call("r3", BAD_PROMPT))
            assert not bad.value.pool_full and not bad.value.retryable
            assert "bad prompt" in str(bad.value)

            # The auth parameter travels: a wrong tag is refused by the model.
            wrong = PrefillCall([1], b"{}", 1, "r4", auth="tag-other")
            with pytest.raises(PrefillFailed, match="bad auth"):
                await client.prefill(wrong)

            # Answers, even refusals, keep the server in rotation.
            stats = client.stats()
            assert stats["servers_up"] == 1 and stats["server_failures"] == 0
            assert (stats["calls"], stats["failures"], stats["pool_full"]) == (4, 3, 1)
            assert stats["outstanding"] == 0
        finally:
            await client.close()

    asyncio.run(run())


def test_cancelling_the_caller_cancels_the_call(
    servers: list[TritonServer], prefill_repo: Path
) -> None:
    marker = prefill_repo / "cancelled"
    marker.unlink(missing_ok=True)

    async def run() -> None:
        client = client_of(servers[0].grpc_url)
        try:
            await client.prefill(call("warm"))  # the channel is up: the slow call starts at once
            task = asyncio.ensure_future(client.prefill(call("slow", SLOW_PROMPT)))
            await asyncio.sleep(0.5)
            assert not task.done()
            started = time.monotonic()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert time.monotonic() - started < 0.5
            stats = client.stats()
            assert stats["cancelled"] == 1 and stats["outstanding"] == 0
            # Triton cancelled the request: the model saw it well before its 10 s ran out.
            await wait_until(marker.exists, 3.0)
            assert marker.read_text() == "slow"
        finally:
            await client.close()

    asyncio.run(run())


def test_failover_from_a_stopped_server_and_its_return(servers: list[TritonServer]) -> None:
    live, other = servers
    urls = (live.grpc_url, other.grpc_url)

    async def run() -> None:
        # A long first backoff: the stopped server returns through a probe, not its backoff.
        client = client_of(*urls, backoff_start_s=30.0)
        try:
            replies = [await client.prefill(call(f"a{i}")) for i in range(4)]
            assert sorted(r.server for r in replies) == sorted(urls * 2)  # ties: round-robin

            other.stop()
            replies = [await client.prefill(call(f"b{i}")) for i in range(4)]
            assert {r.server for r in replies} == {live.grpc_url}
            stats = client.stats()
            # Exactly one call picked the stopped server; it was tried once more on the live one.
            assert (stats["failovers"], stats["server_failures"], stats["failures"]) == (1, 1, 0)
            assert not client.router.is_up(other.grpc_url)
            assert stats["servers_down"] == 1

            other.start(START_TIMEOUT_S)
            await wait_until(lambda: client.router.is_up(other.grpc_url), 5.0)
            replies = [await client.prefill(call(f"c{i}")) for i in range(4)]
            assert other.grpc_url in {r.server for r in replies}
        finally:
            await client.close()

    asyncio.run(run())


def test_no_server_answers() -> None:
    """Two addresses where nothing listens: one failover, then a retryable failure."""
    dead = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]

    async def run() -> None:
        client = client_of(*dead)
        try:
            with pytest.raises(PrefillFailed) as failed:
                await client.prefill(call("x"))
            assert failed.value.retryable and not failed.value.pool_full
            assert "UNAVAILABLE" in str(failed.value)
            stats = client.stats()
            assert (stats["failovers"], stats["server_failures"], stats["failures"]) == (1, 2, 1)
            assert stats["servers_down"] == 2
            # All down: a call still tries the server whose backoff ends first, and fails fast.
            with pytest.raises(PrefillFailed) as again:
                await client.prefill(call("y"))
            assert again.value.retryable
        finally:
            await client.close()

    asyncio.run(run())
