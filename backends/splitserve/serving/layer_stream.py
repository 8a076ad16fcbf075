"""A handed-over request's KV while its prompt pass is still running: decode pulls each layer
as prefill announces it, so that the transfer overlaps the pass instead of following it.

Prefill exports the blocks before its pass and answers with the handle at once; each later
answer says how many layers are written (``announce``). The pulls run on the engine's puller,
one range of announced layers at a time: a layer is never read before its announcement, and a
stopped stream (prefill failed, the request ended) posts no further read. The future of
``start`` ends once every layer is in, or with the error that stopped the stream; the lease is
released either way.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Executor, Future

from splitserve.transport.base import KVTransport


class StreamStopped(RuntimeError):
    """The stream ended before all layers were announced (prefill failed, request ended)."""


class StreamCounts:
    """Counters shared by the streams of one decode instance (read by the metrics thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.streams = 0
        self.layers = 0
        self.wait_ns = 0

    def add(self, *, streams: int = 0, layers: int = 0, wait_ns: int = 0) -> None:
        with self._lock:
            self.streams += streams
            self.layers += layers
            self.wait_ns += wait_ns

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {
                "streamed_requests": self.streams,
                "streamed_layers": self.layers,
                "stream_wait_ns": self.wait_ns,
            }


class LayerStream:
    """The ``StreamedSource`` of one request (see ``engine.scheduler``); thread-safe."""

    def __init__(
        self,
        transport: KVTransport,
        handle: bytes,
        num_layers: int,
        counts: StreamCounts | None = None,
    ) -> None:
        self.transport = transport
        self.handle = handle
        self.num_layers = num_layers
        self.counts = counts or StreamCounts()
        self._lock = threading.Lock()
        self._ready = 0
        self._fetched = 0
        self._busy = False
        """A fetch is posted on the puller."""
        self._stopped: BaseException | None = None
        self._dst: list[int] | None = None
        self._skip = 0
        self._puller: Executor | None = None
        self._idle_since: int | None = None
        """When the pull caught up with the pass (it then waits for the next layer)."""
        self._released = False
        self._done: Future[None] = Future()

    # the prefill stream's side (the model's event loop)

    def announce(self, ready: int) -> None:
        """Prefill says its first ``ready`` layers are written."""
        if not 0 <= ready <= self.num_layers:
            raise ValueError(f"layers_ready {ready} is outside [0, {self.num_layers}]")
        with self._lock:
            self._ready = max(self._ready, ready)
            self._kick()

    def stop(self, why: str) -> None:
        """The stream failed: post no further read; the pull ends with ``StreamStopped``."""
        with self._lock:
            if self._stopped is None and self._fetched < self.num_layers:
                self._stopped = StreamStopped(why)
            self._kick()

    # the engine's side

    def start(self, dst_block_ids: list[int], puller: Executor, skip: int = 0) -> Future[None]:
        """Pull all but the first ``skip`` blocks into ``dst_block_ids`` on ``puller`` as
        layers are announced."""
        with self._lock:
            self._dst, self._puller, self._skip = list(dst_block_ids), puller, skip
            self._kick()
        return self._done

    def cancel(self) -> None:
        """The request ended mid-pull."""
        self.stop("the request ended")

    def discard(self) -> None:
        """The request ended before its pull started."""
        self.stop("the request ended")
        with self._lock:
            self._release()

    @property
    def layers_fetched(self) -> int:
        return self._fetched

    # internals (called with the lock held, except _fetch)

    def _kick(self) -> None:
        if self._busy or self._dst is None or self._done.done():
            return
        if self._stopped is not None:
            self._finish(self._stopped)
        elif self._fetched == self.num_layers:
            self._finish(None)
        elif self._ready > self._fetched:
            if self._idle_since is not None:
                self.counts.add(wait_ns=time.perf_counter_ns() - self._idle_since)
                self._idle_since = None
            assert self._puller is not None
            self._busy = True
            self._puller.submit(self._fetch, range(self._fetched, self._ready))
        elif self._idle_since is None:
            self._idle_since = time.perf_counter_ns()

    def _fetch(self, layers: range) -> None:
        assert self._dst is not None
        try:
            self.transport.fetch_layers(self.handle, self._dst, layers, self._skip)
        except BaseException as exc:
            with self._lock:
                self._busy = False
                self._finish(exc)
            return
        self.counts.add(layers=len(layers), streams=int(layers.stop == self.num_layers))
        with self._lock:
            self._busy = False
            self._fetched = layers.stop
            self._kick()

    def _finish(self, exc: BaseException | None) -> None:
        self._release()
        if exc is None:
            self._done.set_result(None)
        else:
            self._done.set_exception(exc)

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self.transport.release(self.handle)
