"""``PrefillClient`` over gRPC: ``llm`` of a decode server calls the ``prefill`` model of remote
prefill servers (``--role prefill``), chosen per call by ``PrefillRouter``.

Per call: pick the server with the fewest calls in flight, ``infer`` there. A server that does
not answer (connection refused, UNAVAILABLE, deadline, a dead stub) goes out of rotation and
the call is tried once more on another server; an answer (including "pool full") keeps it in.

A background task on the model's event loop, started by the first call, re-resolves discovery,
probes the servers out of rotation every second (``is_server_ready``; an answer brings one back
at once instead of when its backoff ends) and closes the connections of servers that left.

Cancelling the task that awaits ``prefill`` cancels the gRPC call: grpc.aio cancels an RPC whose
awaiting task is cancelled, and tritonserver then cancels the request.

A prefill server whose ``prefill`` is decoupled streams its KV by layer (``kv_stream_layers``):
the call is then a ``stream_infer`` whose first response gives the handle (to the call's
listener), later ones the written-layer counts, the last the first token. Which kind a server
is, is read from its model config at the first call (again after it failed or refused a call
of the other kind: a server restarted with the other setting). Once the handle
went to the listener the call is not retried: a failure then ends the request. Nor is a call
that carries a push target (``kv_target``) retried after its server failed: that server may
have written into the target's blocks, and may still.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from splitserve.serving import bls_contract
from splitserve.serving.prefill_client import (
    PrefillCall,
    PrefillClient,
    PrefillFailed,
    PrefillReply,
    StreamListener,
)
from splitserve.serving.prefill_discovery import Discovery, discovery_from
from splitserve.serving.prefill_router import AFFINITY_SLACK, PrefillRouter
from splitserve.serving.prefix_affinity import PrefixAffinity

if TYPE_CHECKING:
    from splitserve.serving.serving_config import ServingConfig

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 60.0
"""Default gRPC deadline of one prefill call (``ServingConfig.prefill_call_timeout_s``): how a
server that went silent without closing the connection is noticed (``llm`` cancels earlier at
a request's own deadline)."""
PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 1.0

RETRYABLE_STATUS = frozenset(
    {"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "ABORTED", "NOT_FOUND"}
)
"""gRPC codes that mean the server (not the request) failed: it is unreachable or stopping
(UNAVAILABLE; also a Triton model not ready), silent (DEADLINE_EXCEEDED), ended the call itself
(CANCELLED, ABORTED; ours is asyncio.CancelledError instead), or lacks the model (NOT_FOUND)."""
DECOUPLED = "decoupled transaction policy"
"""Triton's refusal of ``infer`` on a decoupled model: the server now streams by layer."""
SERVER_GONE = ("is not healthy", "Request for unknown model")
"""In Triton's errors of a server that cannot take the call now: a Python-backend model whose
stub died, a model not loaded. Read from the message, which is all a streamed call's error
carries (no status code)."""

_MAX_MESSAGE = 2**31 - 1
# grpc's own reconnect backoff grows to 120 s: a restarted server would stay unreachable on the
# old channel long after probes should have found it. Capped near the probe interval instead.
_CHANNEL_ARGS = [
    ("grpc.max_send_message_length", _MAX_MESSAGE),
    ("grpc.max_receive_message_length", _MAX_MESSAGE),
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def status_name(exc: InferenceServerException) -> str:
    """``UNAVAILABLE`` of tritonclient's ``StatusCode.UNAVAILABLE``; "" without a status (an
    error raised by the client itself)."""
    return str(exc.status() or "").removeprefix("StatusCode.")


def classify(server: str, exc: InferenceServerException) -> PrefillFailed:
    """The PrefillFailed of a failed call to ``server``: pool full (an answer: back off and
    call again), retryable (the server failed: try another) or neither (the request failed)."""
    message = str(exc.message() or exc)
    status = status_name(exc)
    text = f"prefill server {server}: {status or 'error'}: {message}"
    if bls_contract.POOL_FULL in message:
        return PrefillFailed(text, pool_full=True)
    retryable = status in RETRYABLE_STATUS or any(words in message for words in SERVER_GONE)
    return PrefillFailed(text, retryable=retryable)


def connect_grpc(server: str) -> Any:
    """A ``tritonclient.grpc.aio`` client of ``server`` (``host:port``); call in the loop."""
    return grpcaio.InferenceServerClient(url=server, channel_args=_CHANNEL_ARGS)


def prefill_inputs(call: PrefillCall) -> list[Any]:
    """The ``prefill`` model's input tensors of ``call`` (``bls_contract`` names)."""
    values: list[tuple[str, np.ndarray, str]] = [
        (bls_contract.INPUT_IDS, np.array([call.prompt_ids], dtype=np.int64), "INT64"),
        (bls_contract.PARAMS, np.array([[call.params_json]], dtype=np.object_), "BYTES"),
        (bls_contract.SEED, np.array([[call.seed]], dtype=np.uint64), "UINT64"),
        (
            bls_contract.REQUEST_ID,
            np.array([[call.request_id.encode()]], dtype=np.object_),
            "BYTES",
        ),
    ]
    if call.kv_target is not None:
        target = np.frombuffer(call.kv_target, dtype=np.uint8)[None, :]
        values.append((bls_contract.KV_TARGET, target, "UINT8"))
    inputs = []
    for name, array, datatype in values:
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _value(result: Any, name: str) -> int | None:
    array = result.as_numpy(name)
    return None if array is None or array.size != 1 else int(array.reshape(-1)[0])


def to_reply(server: str, result: Any) -> PrefillReply:
    first = result.as_numpy(bls_contract.FIRST_TOKEN)
    handle = result.as_numpy(bls_contract.KV_HANDLE)
    if first is None or handle is None or first.size != 1:
        raise PrefillFailed(f"prefill server {server}: reply without first_token and kv_handle")
    return PrefillReply(
        first_token=int(first.reshape(-1)[0]), kv_handle=handle.tobytes(), server=server
    )


def _outputs(*names: str) -> list[Any]:
    return [grpcclient.InferRequestedOutput(name) for name in names]


class _StreamFailed(Exception):
    """Carries the PrefillFailed of a streamed call out of ``_stream``."""

    def __init__(self, failed: PrefillFailed, server_down: bool) -> None:
        super().__init__(str(failed))
        self.failed = failed
        self.server_down = server_down


class RemotePrefillClient(PrefillClient):
    """Calls ``model_name`` on the servers of ``discovery``. Create, call and close it on one
    event loop (the model's); nothing starts before the first call."""

    def __init__(
        self,
        discovery: Discovery,
        *,
        model_name: str = "prefill",
        call_timeout_s: float | None = CALL_TIMEOUT_S,
        probe_interval_s: float = PROBE_INTERVAL_S,
        probe_timeout_s: float = PROBE_TIMEOUT_S,
        router: PrefillRouter | None = None,
        connect: Callable[[str], Any] = connect_grpc,
    ) -> None:
        self.discovery = discovery
        self.model_name = model_name
        self.call_timeout_s = call_timeout_s
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.router = router if router is not None else PrefillRouter()
        self._connect = connect
        self._clients: dict[str, Any] = {}
        self._streams: dict[str, bool] = {}
        """Per server: whether its ``prefill`` streams by layer (is decoupled)."""
        self._task: asyncio.Task[None] | None = None
        self._discovered: asyncio.Event | None = None
        """Set once the first discovery is done (the first calls wait for it)."""
        self._closed = False
        self._counts = dict.fromkeys(
            (
                "calls",
                "failovers",
                "failures",
                "pool_full",
                "cancelled",
                "server_failures",
                "streamed",
            ),
            0,
        )

    @classmethod
    def from_config(cls, cfg: ServingConfig) -> RemotePrefillClient:
        """The client of a decode config with ``prefill_urls`` or ``prefill_dns``."""
        return cls(
            discovery_from(cfg.prefill_urls, cfg.prefill_dns),
            model_name=cfg.prefill_model,
            call_timeout_s=cfg.prefill_call_timeout_s,
            router=PrefillRouter(
                affinity=PrefixAffinity(cfg.engine.block_size),
                affinity_slack=AFFINITY_SLACK if cfg.prefill_routing == "prefix" else None,
            ),
        )

    async def prefill(
        self, call: PrefillCall, listener: StreamListener | None = None
    ) -> PrefillReply:
        if self._closed:
            raise PrefillFailed("prefill client is closed")
        self._counts["calls"] += 1
        self._counts["failovers"] += call.failover
        await self._started()
        inputs = prefill_inputs(call)
        routed = self.router.affinity_slack is not None
        prefix = self.router.affinity.hashes(call.prompt_ids) if routed else []
        tried: set[str] = set()
        failure: PrefillFailed | None = None
        # At most two servers: the picked one and, if it failed as a server, one other.
        while len(tried) < 2:
            server = self.router.pick(exclude=tried, prefix=prefix)
            if server is None:
                break
            if tried:
                self._counts["failovers"] += 1
            tried.add(server)
            try:
                return await self._call(server, call, inputs, listener)
            except PrefillFailed as exc:
                if exc.retryable and call.kv_target is not None:
                    # It may have WRITten into the target's blocks and may write on: another
                    # server's push must go into other blocks (the caller's to reserve).
                    raise PrefillFailed(str(exc), retryable=True, target_spent=True) from None
                if not exc.retryable:
                    self._counts["failures"] += 1
                    self._counts["pool_full"] += exc.pool_full
                    raise exc from None
                failure = exc
        self._counts["failures"] += 1
        if failure is None:
            raise PrefillFailed(
                f"no prefill server known ({self.discovery.describe()})", retryable=True
            )
        raise failure

    async def _call(
        self,
        server: str,
        call: PrefillCall,
        inputs: list[Any],
        listener: StreamListener | None,
    ) -> PrefillReply:
        """One call on ``server``; the router learns how it went."""
        self.router.begin(server)
        try:
            if await self._streams_layers(server):
                reply = await self._stream(server, call, inputs, listener)
            else:
                try:
                    reply = await self._infer(server, call, inputs)
                except InferenceServerException as exc:
                    if DECOUPLED not in str(exc.message()):
                        raise
                    # Restarted with kv_stream_layers since we asked: ask again, call again.
                    self._streams.pop(server, None)
                    reply = await self._stream(server, call, inputs, listener)
        except InferenceServerException as exc:
            failed = classify(server, exc)
            if failed.retryable:
                self._server_failed(server, failed)
            else:
                self.router.mark_ok(server)  # it answered
            raise failed from None
        except _StreamFailed as exc:
            if exc.server_down:
                self._server_failed(server, exc.failed)
            else:
                self.router.mark_ok(server)
            raise exc.failed from None
        except asyncio.CancelledError:
            self._counts["cancelled"] += 1
            raise
        finally:
            self.router.end(server)
        self._counts["streamed"] += reply.streamed
        self.router.mark_ok(server)
        return reply

    async def _infer(self, server: str, call: PrefillCall, inputs: list[Any]) -> PrefillReply:
        result = await self._client(server).infer(
            model_name=self.model_name,
            inputs=inputs,
            outputs=_outputs(bls_contract.FIRST_TOKEN, bls_contract.KV_HANDLE),
            request_id=call.request_id,
            parameters={bls_contract.AUTH: call.auth},
            client_timeout=self.call_timeout_s,
        )
        return to_reply(server, result)

    async def _streams_layers(self, server: str) -> bool:
        known = self._streams.get(server)
        if known is None:
            config = await self._client(server).get_model_config(
                self.model_name, as_json=True, client_timeout=self.probe_timeout_s
            )
            policy = config.get("config", {}).get("model_transaction_policy", {})
            known = self._streams[server] = bool(policy.get("decoupled", False))
        return known

    async def _stream(
        self,
        server: str,
        call: PrefillCall,
        inputs: list[Any],
        listener: StreamListener | None,
    ) -> PrefillReply:
        """The call to a prefill that streams by layer; ``_StreamFailed`` if it fails (its
        ``streamed`` set once the listener holds the handle)."""
        sent = asyncio.Event()
        names = (bls_contract.FIRST_TOKEN, bls_contract.KV_HANDLE, bls_contract.LAYERS_READY)

        async def request() -> Any:
            yield {
                "model_name": self.model_name,
                "inputs": inputs,
                "outputs": _outputs(*names),
                "request_id": call.request_id,
                "parameters": {bls_contract.AUTH: call.auth},
            }
            await sent.wait()  # the stream stays open until the last response arrived

        stream = self._client(server).stream_infer(request(), stream_timeout=self.call_timeout_s)
        handle: bytes | None = None
        streamed = False

        def failed(message: str, server_down: bool = False) -> _StreamFailed:
            if not streamed:
                text = f"prefill server {server}: {message}"
                return _StreamFailed(PrefillFailed(text, retryable=server_down), server_down)
            text = f"prefill server {server} failed mid-stream (the prompt's KV is dropped): "
            return _StreamFailed(PrefillFailed(text + message, streamed=True), server_down)

        def refused(error: InferenceServerException) -> _StreamFailed:
            answered = classify(server, error)
            if not streamed:
                return _StreamFailed(answered, answered.retryable)
            return failed(str(error.message() or error), answered.retryable)

        try:
            async for result, error in stream:
                if error is not None:
                    raise refused(error)
                ready = _value(result, bls_contract.LAYERS_READY)
                if (data := result.as_numpy(bls_contract.KV_HANDLE)) is not None:
                    handle = data.tobytes()
                    # No count: a prefill that does not stream (restarted without it).
                    if listener is not None and ready is not None:
                        listener.handle(handle)
                        streamed = True
                if ready is not None and streamed:
                    assert listener is not None
                    listener.layers(ready)
                first = _value(result, bls_contract.FIRST_TOKEN)
                if first is not None:
                    if handle is None:
                        raise failed("a streamed reply without kv_handle")
                    return PrefillReply(first, handle, server, streamed=streamed)
        except InferenceServerException as exc:
            raise refused(exc) from None
        except grpc.RpcError as exc:
            code = exc.code()
            name = code.name if code is not None else "UNKNOWN"
            raise failed(f"{name}: {exc.details()}", name in RETRYABLE_STATUS) from None
        except asyncio.CancelledError:
            stream.cancel()
            raise
        finally:
            sent.set()
        raise failed("the stream ended without a first token", server_down=True)

    def _server_failed(self, server: str, failed: PrefillFailed) -> None:
        self._counts["server_failures"] += 1
        self._streams.pop(server, None)  # it may come back configured otherwise
        backoff = self.router.mark_failed(server)
        log.warning("%s; out of rotation for %.0f s", failed, backoff)

    def _client(self, server: str) -> Any:
        client = self._clients.get(server)
        if client is None:
            client = self._clients[server] = self._connect(server)
        return client

    async def _started(self) -> None:
        """Start the background task on first use, and wait for the first discovery."""
        if self._task is None:
            self._discovered = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(
                self._maintain(), name="splitserve-prefill-health"
            )
        assert self._discovered is not None
        await self._discovered.wait()

    async def _maintain(self) -> None:
        """Every ``probe_interval_s``: discovery when due, probes, connections of servers gone."""
        assert self._discovered is not None
        while True:
            try:
                await self._refresh()
                self._discovered.set()
                await self._probe()
                await self._close_dropped()
            except Exception:  # the task must outlive any one bad round
                log.exception("prefill health round failed")
            await asyncio.sleep(self.probe_interval_s)

    async def _refresh(self) -> None:
        servers = await self.discovery.poll(time.monotonic())
        if servers is not None and servers != self.router.servers:
            log.info("prefill servers: %s", ", ".join(sorted(servers)) or "none")
            self.router.update(servers)

    async def _probe(self) -> None:
        down = self.router.down()
        ready = await asyncio.gather(*(self._is_ready(s) for s in down))
        for server, ok in zip(down, ready, strict=True):
            if ok:
                log.info("prefill server %s is ready again", server)
                self.router.mark_ok(server)

    async def _is_ready(self, server: str) -> bool:
        try:
            return bool(
                await self._client(server).is_server_ready(client_timeout=self.probe_timeout_s)
            )
        except InferenceServerException:
            return False

    async def _close_dropped(self) -> None:
        """Close the connections of servers discovery dropped, once their calls ended."""
        known = self.router.servers
        for server in list(self._clients):
            if server not in known and not self.router.outstanding(server):
                await self._clients.pop(server).close()

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        clients, self._clients = self._clients, {}
        for client in clients.values():
            await client.close()

    def stats(self) -> dict[str, int]:
        """Safe to call from another thread (the metrics one)."""
        return {**dict(self._counts), **self.router.counts()}
