"""``llm``: the public entry and the decode stage of disaggregated serving.

Per request: validate and tokenize, call prefill once (BLS to the local ``prefill`` model, or
gRPC to the prefill servers of ``--role decode``), stream the first token, hand the request
(with its KV handle) to the engine loop, which pulls the blocks when it has room (over ``nixl``
on a thread of its own, while the batch keeps stepping) and streams every further token straight
to the client. A prefill server that streams its KV by layer answers with the handle before its
pass: the request then enters the engine at once, its layers are pulled as they are written,
and its first token follows when the pass ends (``serving.layer_stream``). With ``kv_push``
the request enters the engine first and prefill WRITEs the KV into the blocks it reserved
(``serving.layer_push``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from splitserve.engine.request import random_seed
from splitserve.kv.pool import KVPool
from splitserve.serving import bls_contract
from splitserve.serving.frontend import Prepared
from splitserve.serving.layer_push import PushedKV, RequestEnded
from splitserve.serving.layer_stream import LayerStream, StreamCounts
from splitserve.serving.loop import TIMED_OUT, EngineLoop
from splitserve.serving.prefill_client import (
    PrefillCall,
    PrefillClient,
    PrefillFailed,
    PrefillReply,
)
from splitserve.transport import get_transport
from splitserve.transport.key import load_key
from splitserve.triton.bls_prefill import BlsPrefillClient
from splitserve.triton.sink import TritonSink
from splitserve.triton.streaming_model import GenerateModelBase

if TYPE_CHECKING:
    from splitserve.transport.nixl import NixlTransport

log = logging.getLogger(__name__)


class PrefillError(RuntimeError):
    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind
        """A ``Sink.fail`` kind: ``internal`` or ``unavailable``."""


class DecodeModel(GenerateModelBase):
    role = "decode"

    def make_pool(self) -> KVPool:
        self.key = load_key()
        self.transport = get_transport(
            self.cfg.transport, key=self.key, **self.cfg.transport_options()
        )
        self.pushes: NixlTransport | None = None
        """The transport, where prefill pushes the KV into blocks reserved here (``kv_push``)."""
        if self.cfg.kv_push:
            from splitserve.transport.nixl import NixlTransport

            assert isinstance(self.transport, NixlTransport)  # kv_push needs nixl (config)
            self.pushes = self.transport
        pool = self.parts.new_pool()
        self.transport.register(pool)
        self.num_layers = pool.layout.num_layers
        self.stream_counts = StreamCounts()
        self.prefill_client = self._prefill_client()
        return pool

    def _after_step(self, loop: EngineLoop) -> None:
        super()._after_step(loop)
        if self.pushes is not None:
            self.pushes.reap_pushes()  # blocks of failed pushes that nothing writes any more

    def make_puller(self) -> Executor | None:
        # A pull over the network lasts up to kv_transfer_timeout_s: off the engine thread, so
        # that the running streams keep stepping meanwhile. Local copies stay in the step.
        if self.cfg.transport != "nixl":
            return None
        self.puller = ThreadPoolExecutor(1, thread_name_prefix="splitserve-kv-pull")
        return self.puller

    def _prefill_client(self) -> PrefillClient:
        """BLS to the local ``prefill`` model, or gRPC to the prefill servers of the spec."""
        if not self.cfg.remote_prefill:
            return BlsPrefillClient(self.cfg.prefill_model, self.transport.release)
        from splitserve.serving.remote_prefill import RemotePrefillClient

        return RemotePrefillClient.from_config(self.cfg)

    def transport_counts(self) -> dict[str, int]:
        counts = self.transport.stats()
        counts.update({f"prefill_{k}": v for k, v in self.prefill_client.stats().items()})
        counts.update(self.stream_counts.as_dict())
        return counts

    async def execute(self, requests: list[Any]) -> None:
        await asyncio.gather(*(self._handle(r) for r in requests))

    async def _handle(self, request: Any) -> None:
        taken = self.intake(request)
        if taken is None:
            return
        prep, sink, rid = taken
        handle = b""
        seed = prep.gen.params.seed if prep.gen.params.seed is not None else random_seed()
        if self.pushes is not None:
            await self._pushed(request, rid, prep, seed, sink)
            return
        handoff = _Handoff(self, rid, prep, seed, sink)
        try:
            prefilled = await self._prefill(request, rid, prep, seed, handoff)
            if handoff.stream is not None:
                if prefilled is not None:
                    self.loop.first_token(rid, prefilled[0])
                return  # a cancelled client: the loop ends the request (it polls the client)
            if prefilled is None:
                sink.cancel()
                return
            first, handle = prefilled
            source = bls_contract.TransportSource(self.transport, handle)
            self.loop.add_prefilled(
                rid, prep.prompt_ids, prep.gen.params, first, seed, source, sink, prep.deadline
            )
        except PrefillError as exc:
            handoff.fail(str(exc), exc.kind)
        except Exception as exc:  # every request must end with FINAL, whatever went wrong
            log.exception("request %s failed before decode", rid)
            if handle:
                self.transport.release(handle)
            handoff.fail(f"internal error: {exc}", "internal")

    async def _pushed(
        self, request: Any, rid: str, prep: Prepared, seed: int, sink: TritonSink
    ) -> None:
        """The request enters the engine first; once its blocks are reserved, prefill is called
        with a target naming them and pushes the KV there (``serving.layer_push``)."""
        assert self.pushes is not None  # kv_push
        source = PushedKV(
            self.pushes,
            len(prep.prompt_ids),
            self.cfg.engine.block_size,
            asyncio.get_running_loop(),
        )
        params = prep.gen.params
        self.loop.add_streaming(rid, prep.prompt_ids, params, seed, source, sink, prep.deadline)

        def fail(why: str, kind: str) -> None:
            source.failed(why)  # its blocks wait until no WRITE can land in them
            self.loop.fail_request(rid, why, kind)

        failover = False
        while True:
            try:
                target = await source.target()
            except RequestEnded:
                return  # the engine ended it (cancelled, past its deadline) and told the client
            try:
                prefilled = await self._prefill(request, rid, prep, seed, None, target, failover)
                break
            except PrefillFailed as exc:  # its server failed, and may write on into the blocks
                if failover:
                    fail(
                        f"prefill unavailable: {exc} (the prompt's KV push is dropped)",
                        "unavailable",
                    )
                    return
                source.again(str(exc))  # once more, on another server, into other blocks
                failover = True
            except PrefillError as exc:
                fail(str(exc), exc.kind)
                return
            except Exception as exc:  # every request must end with FINAL, whatever went wrong
                log.exception("request %s failed before decode", rid)
                fail(f"internal error: {exc}", "internal")
                return
        if prefilled is None:
            source.failed("the client cancelled")  # the loop ends the request (it polls)
            return
        first, handle = prefilled
        if target is None:
            self.transport.release(handle)  # every block cached here: nothing to fetch
        elif handle != target:  # a prefill that did not push (it leased the KV instead)
            self.transport.release(handle)
            fail("the prefill server answered a push with a handle of its own", "internal")
            return
        source.arrived()
        self.loop.first_token(rid, first)

    async def _prefill(
        self,
        request: Any,
        rid: str,
        prep: Prepared,
        seed: int,
        handoff: _Handoff | None,
        target: bytes | None = None,
        failover: bool = False,
    ) -> tuple[int, bytes] | None:
        """The first token and KV handle from prefill, retried while its pool is full; None
        (and no lease held) if the client cancelled meanwhile. PrefillError once the request's
        deadline passed, too. A streaming prefill hands the handle to ``handoff`` early; a
        push whose server failed raises its ``PrefillFailed`` (``target_spent``)."""
        call = PrefillCall(
            prompt_ids=list(prep.prompt_ids),
            params_json=bls_contract.params_to_json(prep.gen.params),
            seed=seed,
            request_id=rid,
            auth=bls_contract.auth_tag(self.key, rid),
            kv_target=target,
            failover=failover,
        )
        retry_until = time.monotonic() + self.cfg.prefill_retry_s
        delay = 0.005
        while True:
            try:
                reply = await self._call_prefill(request, call, prep.deadline, handoff)
                break
            except PrefillFailed as exc:
                if exc.target_spent:
                    raise
                if exc.streamed:
                    raise PrefillError(str(exc), "unavailable") from None
                # A full pool, or every prefill server failing (restarting, unreachable): tried
                # again until prefill_retry_s; anything else is the request's own failure.
                if not (exc.pool_full or exc.retryable):
                    raise PrefillError(f"prefill failed: {exc}", "internal") from None
                if time.monotonic() > retry_until:
                    busy = "server busy" if exc.pool_full else "prefill unavailable"
                    raise PrefillError(f"{busy}: {exc}", "unavailable") from None
            await asyncio.sleep(delay)
            # Asked between tries: a request nobody waits for must not retry on.
            if request.is_cancelled():
                return None
            delay = min(delay * 2, 0.2)
        if reply is None or request.is_cancelled():
            if reply is not None and not reply.streamed and target is None:
                self.transport.release(reply.kv_handle)
            return None
        return reply.first_token, reply.kv_handle

    async def _call_prefill(
        self, request: Any, call: PrefillCall, deadline: float | None, handoff: _Handoff | None
    ) -> PrefillReply | None:
        """One prefill call, waited for until ``deadline`` while the client is still there.
        None if the client cancelled: the call is cancelled (a remote one stops; a BLS one runs
        on and its client releases the lease it returns), so no lease waits to expire."""
        if deadline is not None and time.monotonic() >= deadline:
            raise PrefillError(TIMED_OUT, "unavailable")
        task = asyncio.ensure_future(self.prefill_client.prefill(call, handoff))
        while True:
            wait = self.cfg.cancel_poll_s
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
            done, _ = await asyncio.wait({task}, timeout=max(wait, 0.0))
            if done:
                return task.result()
            timed_out = deadline is not None and time.monotonic() >= deadline
            if timed_out or request.is_cancelled():
                task.cancel()
                if timed_out:
                    raise PrefillError(TIMED_OUT, "unavailable")
                return None

    def finalize(self) -> None:
        super().finalize()
        puller = getattr(self, "puller", None)
        if puller is not None:  # no read may run on a closed transport
            puller.shutdown(wait=True, cancel_futures=True)
        self.transport.close()


class _Handoff:
    """One request's ``StreamListener``: on the handle, the request enters the engine with a
    ``LayerStream`` that pulls each announced layer. Until then, the request's end is this
    model's to send; from then on, the engine loop's."""

    def __init__(
        self, model: DecodeModel, rid: str, prep: Prepared, seed: int, sink: TritonSink
    ) -> None:
        self.model = model
        self.rid = rid
        self.prep = prep
        self.seed = seed
        self.sink = sink
        self.stream: LayerStream | None = None

    def handle(self, kv_handle: bytes) -> None:
        model, prep = self.model, self.prep
        self.stream = LayerStream(model.transport, kv_handle, model.num_layers, model.stream_counts)
        model.loop.add_streaming(
            self.rid, prep.prompt_ids, prep.gen.params, self.seed, self.stream, self.sink,
            prep.deadline,
        )  # fmt: skip

    def layers(self, ready: int) -> None:
        assert self.stream is not None
        self.stream.announce(ready)

    def fail(self, message: str, kind: str) -> None:
        """End the request with an error, whoever holds it now."""
        if self.stream is None:
            self.sink.fail(message, kind)
            return
        self.stream.stop(message)
        self.model.loop.fail_request(self.rid, message, kind)
