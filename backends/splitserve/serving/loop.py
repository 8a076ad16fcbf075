"""One thread that owns an engine: applies submitted work, steps, and routes outputs.

The Triton adapters only enqueue: requests, handed-over requests and aborts go through the
inbox and are applied between steps, so the engine itself is only ever touched by this thread.
Between steps it also ends the requests whose client cancelled or whose deadline passed.
"""

from __future__ import annotations

import heapq
import logging
import queue
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

from splitserve.engine.engine import Engine
from splitserve.engine.output import RequestOutput
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import KVSource, StreamedSource
from splitserve.serving.heap import HeapTrimmer

log = logging.getLogger(__name__)

TIMED_OUT = (
    "request timed out: it did not finish within its 'timeout'/'deadline_ms' "
    "(sampling_parameters) or the server's request_timeout_s"
)
"""The error (``unavailable``: Triton has no deadline code) of a request past its deadline."""


class Sink(Protocol):
    """Where one request's outputs go (a Triton response sender, or a list in tests)."""

    def send(self, out: RequestOutput) -> None:
        """Deliver an output; the one with ``finished`` set is the last."""

    def fail(self, message: str, kind: str) -> None:
        """End the request with an error; ``kind`` is ``invalid``, ``internal`` or
        ``unavailable``."""

    def cancelled(self) -> bool:
        """Whether the client gave up on the request."""


Command = Callable[[Engine], None]


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        cancel_poll_s: float = 0.1,
        name: str = "engine",
        after_step: Callable[[EngineLoop], None] | None = None,
        on_step: Callable[[float, int, float], None] | None = None,
        around_step: Callable[[int], AbstractContextManager[object]] | None = None,
    ) -> None:
        """``after_step`` runs on every turn of the loop, stepped or idle; ``on_step`` after each
        step with its seconds, the number of outputs (tokens sampled) it made and the loop
        thread's CPU seconds in it; each step runs inside a fresh ``around_step(n)``, ``n`` the
        requests the engine holds going into it (e.g. ``core_lend.Borrower.step``)."""
        self.engine = engine
        self.after_step = after_step
        self.on_step = on_step
        self.around_step = around_step
        self.cancel_poll_s = cancel_poll_s
        self._inbox: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._deadlines: dict[str, float] = {}
        """``time.monotonic()`` deadlines of the requests in ``_sinks`` that have one."""
        self._by_deadline: list[tuple[float, str]] = []
        """The same, soonest first (entries of requests gone are skipped when they come up), so
        a step checks one entry, not every request."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stopped = False
        self._draining: str | None = None
        self.num_steps = 0
        self.heap = HeapTrimmer()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopped = True
        self._inbox.put(None)
        self._thread.join(timeout_s)

    @property
    def num_active(self) -> int:
        return len(self._sinks)

    @property
    def draining(self) -> bool:
        return self._draining is not None

    def drain(self, message: str) -> None:
        """End every request, running or submitted from now on, with ``unavailable``."""
        self._draining = message
        self._inbox.put(None)

    def add_request(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        sink: Sink,
        deadline: float | None = None,
    ) -> None:
        """``deadline`` (``time.monotonic()``): past it the request ends with ``TIMED_OUT``."""

        def command(engine: Engine) -> None:
            engine.add_request(rid, prompt_ids, params)
            self._track(rid, sink, deadline)

        self._submit(command, sink)

    def add_prefilled(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        first_token: int,
        seed: int,
        source: KVSource,
        sink: Sink,
        deadline: float | None = None,
    ) -> None:
        """A request whose prompt another engine computed; ``deadline`` as in ``add_request``."""

        def command(engine: Engine) -> None:
            out = engine.add_prefilled(rid, prompt_ids, params, first_token, seed, source)
            if not out.finished:
                self._track(rid, sink, deadline)
            sink.send(out)

        self._submit(command, sink)

    def add_streaming(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        seed: int,
        source: StreamedSource,
        sink: Sink,
        deadline: float | None = None,
    ) -> None:
        """A request whose prompt pass is still running elsewhere: ``source`` pulls its KV as
        layers are written, ``first_token`` delivers its first token."""

        def command(engine: Engine) -> None:
            engine.add_streaming(rid, prompt_ids, params, seed, source)
            self._track(rid, sink, deadline)

        self._submit(command, sink)

    def first_token(self, rid: str, token: int) -> None:
        """The first token of a streamed request: to its client at once (its pull may still
        be running)."""

        def command(engine: Engine) -> None:
            out = engine.first_token(rid, token)
            if out is not None:
                self._dispatch([out])

        self._inbox.put(command)

    def fail_request(self, rid: str, message: str, kind: str) -> None:
        """End ``rid`` with an error if it is still running here (else nothing)."""

        def command(engine: Engine) -> None:
            if rid in self._sinks:
                engine.abort(rid)
                self._untrack(rid).fail(message, kind)

        self._inbox.put(command)

    def _track(self, rid: str, sink: Sink, deadline: float | None) -> None:
        self._sinks[rid] = sink
        if deadline is not None:
            self._deadlines[rid] = deadline
            heapq.heappush(self._by_deadline, (deadline, rid))

    def _untrack(self, rid: str) -> Sink:
        if self._deadlines.pop(rid, None) is not None and not self._deadlines:
            self._by_deadline.clear()
        return self._sinks.pop(rid)

    def call(self, fn: Command) -> None:
        """Run ``fn(engine)`` on the loop thread between steps."""
        self._inbox.put(fn)

    def _submit(self, command: Command, sink: Sink) -> None:
        def guarded(engine: Engine) -> None:
            try:
                command(engine)
            except ValueError as exc:
                sink.fail(str(exc), "invalid")

        self._inbox.put(guarded)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
            while True:
                if item is not None:
                    item(self.engine)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _poll_cancelled(self) -> None:
        for rid, sink in list(self._sinks.items()):
            if sink.cancelled():
                self.engine.abort(rid)
                self._untrack(rid)
                sink.send(self._cancelled_output(rid))

    def _expire(self) -> None:
        """End the requests past their deadline, wherever they are, and free their blocks."""
        now = time.monotonic()
        while self._by_deadline and self._by_deadline[0][0] <= now:
            deadline, rid = heapq.heappop(self._by_deadline)
            if self._deadlines.get(rid) == deadline:
                self.engine.abort(rid)
                self._untrack(rid).fail(TIMED_OUT, "unavailable")

    @staticmethod
    def _cancelled_output(rid: str) -> RequestOutput:
        return RequestOutput(rid, [], "", True, "cancelled", 0, 0)

    def _run(self) -> None:
        last_poll = time.monotonic()
        while not self._stopped:
            self._drain(block=not self.engine.has_unfinished())
            if self._draining is not None:
                self._fail_all(self._draining, "unavailable")
            if time.monotonic() - last_poll >= self.cancel_poll_s:
                self._poll_cancelled()
                last_poll = time.monotonic()
            if self._deadlines:
                self._expire()
            if self.after_step is not None:
                self.after_step(self)
            if not self.engine.has_unfinished():
                continue
            size = self.engine.scheduler.num_unfinished
            around = self.around_step(size) if self.around_step else nullcontext()
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                with around:
                    outputs = self.engine.step()
            except Exception as exc:
                log.exception("engine step failed")
                self._fail_all(f"engine step failed: {exc}", "internal")
                continue
            self.num_steps += 1
            if self.on_step is not None:
                self.on_step(time.perf_counter() - start, len(outputs), time.thread_time() - cpu)
            self._dispatch(outputs)
            self.heap.maybe_trim()
        self._fail_all("server is shutting down", "unavailable")

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Route outputs to their sinks. A method of its own so that no frame outlives the
        request's sink: Triton unloads a decoupled model only once every response sender of
        it has been garbage-collected."""
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                self._untrack(out.request_id)
            if out.error is not None:
                sink.fail(out.error, "unavailable")
            else:
                sink.send(out)

    def _fail_all(self, message: str, kind: str) -> None:
        for rid, sink in list(self._sinks.items()):
            self.engine.abort(rid)
            sink.fail(message, kind)
        self._sinks.clear()
        self._deadlines.clear()
        self._by_deadline.clear()
