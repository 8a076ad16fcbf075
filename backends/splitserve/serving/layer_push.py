"""A request whose prefill pushes its KV (``kv_push``): decode reserves the prompt's blocks
first, then calls prefill with a target naming them, and prefill WRITEs each layer into them as
its pass writes it (``transport.nixl_push``). Prefill answers once every WRITE is done, so its
answer is the only signal: the pass pays no per-layer response and no READ request per layer.

The request enters the engine at once, as a streamed one; when the engine has reserved its
blocks (``start``) the target goes to the model's event loop (``target``), which calls prefill
with it. The reply ends the load (``arrived``); a failed call, or the request ending first,
leaves the blocks to the transport until no WRITE can land in them (``BlocksStillWritten``).
A call whose server failed may be tried once more on another server, but only into other
blocks (``again``): the failed one may write on into the first ones.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Executor, Future
from typing import Protocol

from splitserve.engine.scheduler import LoadAgain
from splitserve.kv.allocator import BlocksStillWritten


class PushTransport(Protocol):
    """What a push source needs of the transport (``NixlTransport`` with ``accept_pushes``)."""

    def push_target(self, dst_block_ids: list[int], num_tokens: int) -> bytes: ...

    def push_arrived(self, target: bytes) -> None: ...

    def push_failed(self, target: bytes, why: str) -> BlocksStillWritten: ...


class RequestEnded(Exception):
    """The request ended in the engine before its blocks were reserved: nothing to call."""


class PushedKV:
    """The ``StreamedSource`` of one pushed request; thread-safe."""

    def __init__(
        self,
        transport: PushTransport,
        num_tokens: int,
        block_size: int,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.transport = transport
        self.num_tokens = num_tokens
        self.block_size = block_size
        self._loop = loop
        self._target: asyncio.Future[bytes | None] = loop.create_future()
        self._lock = threading.Lock()
        self._sent: bytes | None = None
        """The target handed out (None: none yet, or nothing to push)."""
        self._puller: Executor | None = None
        self._done: Future[None] = Future()

    # the engine's side

    def start(self, dst_block_ids: list[int], puller: Executor, skip: int = 0) -> Future[None]:
        """Blocks reserved: name them in a target for the prefill call. All cached here
        (nothing to push): the target is None and the load ends with the reply."""
        tokens = min(self.num_tokens - skip * self.block_size, len(dst_block_ids) * self.block_size)
        with self._lock:
            self._puller = puller
            if dst_block_ids:
                self._sent = self.transport.push_target(dst_block_ids, tokens)
            self._loop.call_soon_threadsafe(_resolve, self._target, self._sent)
            return self._done

    def cancel(self) -> None:
        """The request ended while its push was under way."""
        self.failed("the request ended")

    def again(self, why: str) -> None:
        """The call failed with its server: leave the blocks to the transport and wait for the
        engine to reserve others (``start`` again, a new ``target``). The model's event loop."""
        with self._lock:
            if self._done.done() or self._sent is None:
                return
            held = self.transport.push_failed(self._sent, why)
            done, self._done = self._done, Future()
            self._target = self._loop.create_future()
            self._sent = None
            done.set_exception(LoadAgain(why, held.block_ids))

    def discard(self) -> None:
        """The request ended before its blocks were reserved."""
        self._loop.call_soon_threadsafe(_refuse, self._target)

    # the model's side (its event loop)

    async def target(self) -> bytes | None:
        """The target to call prefill with, once the engine reserved the blocks; None: every
        block was cached here. RequestEnded if the request ended first."""
        return await self._target

    def arrived(self) -> None:
        """Prefill answered: the KV is in (decoded from fp8 on the puller, where it came so)."""
        with self._lock:
            if self._done.done() or self._puller is None:
                return
            if self._sent is None:
                self._done.set_result(None)
                return
            loading = self._puller.submit(self.transport.push_arrived, self._sent)
        loading.add_done_callback(lambda f: self._end(f.exception()))

    def failed(self, why: str) -> None:
        """The call failed, or the request ended: the blocks wait until no WRITE can come."""
        with self._lock:
            if self._done.done():
                return
            if self._sent is None:
                self._done.set_exception(RequestEnded(why))
                self._loop.call_soon_threadsafe(_refuse, self._target)
                return
            exc = self.transport.push_failed(self._sent, why)
            self._done.set_exception(exc)

    def _end(self, exc: BaseException | None) -> None:
        with self._lock:
            if self._done.done():
                return
            if exc is None:
                self._done.set_result(None)
            else:
                self._done.set_exception(exc)


def _resolve(future: asyncio.Future[bytes | None], target: bytes | None) -> None:
    if not future.done():
        future.set_result(target)


def _refuse(future: asyncio.Future[bytes | None]) -> None:
    if not future.done():
        future.set_exception(RequestEnded("the request ended before its blocks were reserved"))
