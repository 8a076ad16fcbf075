"""RemotePrefillClient's decisions with fake gRPC clients: how errors are classified, when a call
fails over, what the background task does (discovery, probes, closing dropped connections).
The real gRPC path is tests/integration/test_remote_prefill_client.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from splitserve.serving import bls_contract
from splitserve.serving.prefill_client import PrefillCall, PrefillFailed
from splitserve.serving.prefill_discovery import DnsDiscovery, StaticDiscovery
from splitserve.serving.prefill_router import PrefillRouter
from splitserve.serving.remote_prefill import RemotePrefillClient, classify

CALL = PrefillCall([1, 2, 3], b"{}", 1, "r", "tag")


def error(status: str | None, message: str) -> InferenceServerException:
    return InferenceServerException(msg=message, status=status)


@pytest.mark.parametrize(
    ("status", "message", "pool_full", "retryable"),
    [
        (
            "StatusCode.UNAVAILABLE",
            f"{bls_contract.POOL_FULL}: needs 3 blocks, 0 free",
            True,
            False,
        ),
        ("StatusCode.UNAVAILABLE", "failed to connect to all addresses", False, True),
        ("StatusCode.DEADLINE_EXCEEDED", "Deadline Exceeded", False, True),
        ("StatusCode.CANCELLED", "server shutting down", False, True),
        ("StatusCode.NOT_FOUND", "Request for unknown model: 'prefill'", False, True),
        ("StatusCode.INTERNAL", "Stub process 'prefill_0_0' is not healthy.", False, True),
        ("StatusCode.INTERNAL", "prefill failed: boom", False, False),
        (None, "Request for unknown model: 'prefill' is not found", False, True),
        (None, "Stub process 'prefill_0_0' is not healthy.", False, True),
        ("StatusCode.INVALID_ARGUMENT", "bad input", False, False),
        (None, "client-side error", False, False),
    ],
)
def test_classify(status: str | None, message: str, pool_full: bool, retryable: bool) -> None:
    failed = classify("h:1", error(status, message))
    assert (failed.pool_full, failed.retryable) == (pool_full, retryable)
    assert "prefill server h:1" in str(failed) and message in str(failed)


class Result:
    def __init__(self, server: str) -> None:
        self.server = server

    def as_numpy(self, name: str) -> np.ndarray:
        if name == bls_contract.FIRST_TOKEN:
            return np.array([[42]], dtype=np.int64)
        return np.frombuffer(self.server.encode(), dtype=np.uint8).reshape(1, -1)


class FakeClient:
    def __init__(self, server: str, fleet: Fleet) -> None:
        self.server = server
        self.fleet = fleet
        self.closed = False

    async def infer(self, **kwargs: Any) -> Result:
        assert not self.closed
        self.fleet.calls.append((self.server, kwargs))
        failure = self.fleet.errors.get(self.server)
        if failure is not None:
            raise failure
        return Result(self.server)

    async def get_model_config(self, model_name: str, **kwargs: Any) -> dict[str, Any]:
        policy = {"decoupled": self.server in self.fleet.streams}
        return {"config": {"name": model_name, "model_transaction_policy": policy}}

    def stream_infer(self, requests: Any, stream_timeout: float | None = None) -> FakeStream:
        if self.server not in self.fleet.streams:
            raise AssertionError("stream_infer on a server that does not stream")
        return FakeStream(self.fleet.streams[self.server], requests)

    async def is_server_ready(self, client_timeout: float | None = None) -> bool:
        if self.server in self.fleet.errors:
            raise error("StatusCode.UNAVAILABLE", "down")
        return True

    async def close(self) -> None:
        self.closed = True


class Streamed:
    """One response of a streaming prefill: outputs by name (absent: not sent)."""

    def __init__(self, **outputs: Any) -> None:
        self.outputs = outputs

    def as_numpy(self, name: str) -> np.ndarray | None:
        value = self.outputs.get(name)
        if value is None:
            return None
        if isinstance(value, bytes):
            return np.frombuffer(value, dtype=np.uint8).reshape(1, -1)
        return np.array([[value]])


class FakeStream:
    """``stream_infer``'s iterator over scripted responses; an exception in the script is
    raised where it stands."""

    def __init__(self, script: list[Any], requests: Any) -> None:
        self.script = list(script)
        self.requests = requests
        self.cancelled = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> tuple[Any, Any]:
        if not self.script:
            raise StopAsyncIteration
        item = self.script.pop(0)
        if isinstance(item, InferenceServerException):
            return None, item
        if isinstance(item, BaseException):
            raise item
        return item, None

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class Listener:
    def __init__(self) -> None:
        self.events: list[Any] = []

    def handle(self, kv_handle: bytes) -> None:
        self.events.append(kv_handle)

    def layers(self, ready: int) -> None:
        self.events.append(ready)


class Fleet:
    """Fake servers: ``errors`` says which fail and how; ``streams`` which stream by layer,
    and what they answer."""

    def __init__(self) -> None:
        self.streams: dict[str, list[Any]] = {}
        self.errors: dict[str, InferenceServerException] = {}
        self.clients: dict[str, FakeClient] = {}
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def connect(self, server: str) -> FakeClient:
        assert server not in self.clients or self.clients[server].closed
        self.clients[server] = FakeClient(server, self)
        return self.clients[server]


def make(fleet: Fleet, *servers: str, **kwargs: Any) -> RemotePrefillClient:
    kwargs.setdefault("discovery", StaticDiscovery(servers))
    return RemotePrefillClient(
        router=PrefillRouter(backoff_start_s=30.0), connect=fleet.connect, **kwargs
    )


def run(body: Callable[[], Any]) -> None:
    asyncio.run(body())


def test_request_carries_the_contract() -> None:
    fleet = Fleet()

    async def body() -> None:
        client = make(fleet, "a:1", model_name="prefill_x", call_timeout_s=7.0)
        reply = await client.prefill(CALL)
        assert (reply.first_token, reply.kv_handle, reply.server) == (42, b"a:1", "a:1")
        await client.close()

    run(body)
    ((server, kwargs),) = fleet.calls
    assert server == "a:1"
    assert kwargs["model_name"] == "prefill_x" and kwargs["client_timeout"] == 7.0
    assert kwargs["request_id"] == "r" and kwargs["parameters"] == {bls_contract.AUTH: "tag"}
    names = [(i.name(), i.datatype(), i.shape()) for i in kwargs["inputs"]]
    assert names == [
        (bls_contract.INPUT_IDS, "INT64", [1, 3]),
        (bls_contract.PARAMS, "BYTES", [1, 1]),
        (bls_contract.SEED, "UINT64", [1, 1]),
        (bls_contract.REQUEST_ID, "BYTES", [1, 1]),
    ]
    assert [o.name() for o in kwargs["outputs"]] == [
        bls_contract.FIRST_TOKEN,
        bls_contract.KV_HANDLE,
    ]
    assert fleet.clients["a:1"].closed


def test_deadline_fails_over_once_and_pool_full_does_not() -> None:
    fleet = Fleet()

    async def body() -> None:
        client = make(fleet, "a:1", "b:1", "c:1")
        fleet.errors["a:1"] = error("StatusCode.DEADLINE_EXCEEDED", "Deadline Exceeded")
        fleet.errors["b:1"] = error("StatusCode.UNAVAILABLE", "connection refused")
        # a fails, b (the one retry) fails too: c is not tried.
        with pytest.raises(PrefillFailed) as failed:
            await client.prefill(CALL)
        assert failed.value.retryable and "b:1" in str(failed.value)
        assert [s for s, _ in fleet.calls] == ["a:1", "b:1"]
        assert client.router.down() == ["a:1", "b:1"]
        assert (await client.prefill(CALL)).server == "c:1"

        fleet.errors["c:1"] = error("StatusCode.UNAVAILABLE", f"{bls_contract.POOL_FULL}: x")
        with pytest.raises(PrefillFailed) as full:
            await client.prefill(CALL)
        assert full.value.pool_full
        assert client.router.is_up("c:1")
        stats = client.stats()
        assert stats["calls"] == 3 and stats["failovers"] == 1 and stats["failures"] == 2
        assert stats["pool_full"] == 1 and stats["server_failures"] == 2
        await client.close()

    run(body)


HANDLE, TOKEN, LAYERS = bls_contract.KV_HANDLE, bls_contract.FIRST_TOKEN, bls_contract.LAYERS_READY


def streamed(**fields: Any) -> Streamed:
    names = {"handle": HANDLE, "token": TOKEN, "layers": LAYERS}
    return Streamed(**{names[k]: v for k, v in fields.items()})


def test_a_streaming_server_gives_the_listener_the_handle_then_each_count() -> None:
    fleet = Fleet()
    fleet.streams["a:1"] = [
        streamed(handle=b"h", layers=0),
        streamed(layers=1),
        streamed(layers=3),
        streamed(token=7, layers=4),
    ]

    async def body() -> None:
        client = make(fleet, "a:1")
        listener = Listener()
        reply = await client.prefill(CALL, listener)
        assert (reply.first_token, reply.kv_handle, reply.streamed) == (7, b"h", True)
        assert listener.events == [b"h", 0, 1, 3, 4]
        assert client.stats()["streamed"] == 1
        await client.close()

    run(body)


def test_a_failure_before_the_handle_fails_over_and_after_it_ends_the_call() -> None:
    fleet = Fleet()
    died = error(None, "Stub process 'prefill_0_0' is not healthy.")
    fleet.streams["a:1"] = [died]
    fleet.streams["b:1"] = [streamed(handle=b"h", layers=0), streamed(layers=2), died]

    async def body() -> None:
        client = make(fleet, "a:1", "b:1")
        listener = Listener()
        with pytest.raises(PrefillFailed) as failed:
            await client.prefill(CALL, listener)
        # a died before answering: b was tried; b died mid-stream: not retried, not retryable.
        assert failed.value.streamed and not failed.value.retryable
        assert "b:1" in str(failed.value) and "mid-stream" in str(failed.value)
        assert listener.events == [b"h", 0, 2]
        assert client.router.down() == ["a:1", "b:1"]
        await client.close()

    run(body)


def test_a_whole_reply_on_a_stream_is_not_streamed() -> None:
    fleet = Fleet()
    fleet.streams["a:1"] = [streamed(handle=b"h", token=9)]

    async def body() -> None:
        client = make(fleet, "a:1")
        listener = Listener()
        reply = await client.prefill(CALL, listener)
        assert (reply.first_token, reply.streamed, listener.events) == (9, False, [])
        await client.close()

    run(body)


def test_probe_brings_a_server_back() -> None:
    fleet = Fleet()

    async def body() -> None:
        client = make(fleet, "a:1", "b:1", probe_interval_s=0.01)
        fleet.errors["a:1"] = error("StatusCode.UNAVAILABLE", "down")
        assert (await client.prefill(CALL)).server == "b:1"
        assert client.router.down() == ["a:1"]
        await asyncio.sleep(0.05)
        assert client.router.down() == ["a:1"]  # probes fail while it is down
        del fleet.errors["a:1"]
        for _ in range(100):
            if not client.router.down():
                break
            await asyncio.sleep(0.01)
        assert client.router.down() == []  # long before its 30 s backoff
        await client.close()

    run(body)


def test_dns_changes_reach_the_router_and_dropped_connections_close() -> None:
    fleet = Fleet()
    records = [["10.0.0.1"]]

    def resolver(host: str, port: int, family: int, type: int) -> list[Any]:
        return [(2, 1, 6, "", (address, port)) for address in records[0]]

    async def body() -> None:
        discovery = DnsDiscovery("prefill", 8001, interval_s=0.01, resolver=resolver)
        client = make(fleet, discovery=discovery, probe_interval_s=0.01)
        assert (await client.prefill(CALL)).server == "10.0.0.1:8001"
        records[0] = ["10.0.0.2"]
        for _ in range(200):
            if client.router.servers == {"10.0.0.2:8001"} and fleet.clients["10.0.0.1:8001"].closed:
                break
            await asyncio.sleep(0.01)
        assert client.router.servers == {"10.0.0.2:8001"}
        assert fleet.clients["10.0.0.1:8001"].closed
        assert (await client.prefill(CALL)).server == "10.0.0.2:8001"
        await client.close()
        with pytest.raises(PrefillFailed, match="closed"):
            await client.prefill(CALL)

    run(body)
    assert all(c.closed for c in fleet.clients.values())


def test_no_server_known() -> None:
    fleet = Fleet()

    def resolver(host: str, port: int, family: int, type: int) -> list[Any]:
        raise OSError("no such name")

    async def body() -> None:
        client = make(fleet, discovery=DnsDiscovery("nowhere", resolver=resolver))
        with pytest.raises(PrefillFailed, match="no prefill server known") as failed:
            await client.prefill(CALL)
        assert failed.value.retryable
        await client.close()

    run(body)
