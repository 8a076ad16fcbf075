"""Streams engine outputs to a Triton response sender from one sender thread.

Building and sending a response costs the stub CPU time; doing it on a thread of its own lets
the sends of step n overlap the compute of step n+1 (torch releases the GIL in its kernels).
A streamed request has at most one send queued: text that arrives while it waits joins it, so
a stream the sender has fallen behind on gets one response with several tokens, not one
response per token (the final one carries ``num_output_tokens``, which clients count by).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from splitserve.engine.output import RequestOutput
from splitserve.serving.inputs import GenerateRequest
from splitserve.serving.stats import InstanceStats
from splitserve.triton.tensors import FINAL, bytes_tensor, error_response

log = logging.getLogger(__name__)

ERROR_CODES = {"invalid": "INVALID_ARG", "internal": "INTERNAL", "unavailable": "UNAVAILABLE"}
"""Sink error kinds -> ``pb_utils.TritonError`` code names (which exist only after import)."""


class SenderThread:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.sent = 0
        self.cpu_s = 0.0
        """Sends run, and the CPU time they took (read by the metrics thread)."""
        self._thread = threading.Thread(target=self._run, name="sender", daemon=True)
        self._thread.start()

    def put(self, send: Callable[[], None]) -> None:
        """Run ``send`` on the sender thread, after everything put before it."""
        self._queue.put(send)

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(5)

    def _run(self) -> None:
        while self._send_next():
            pass

    def _send_next(self) -> bool:
        """Run one queued send; False on the stop marker. Locals die on return, so an idle
        thread holds no response sender (Triton waits for every sender of a decoupled model to
        be collected before it unloads the model)."""
        send = self._queue.get()
        if send is None:
            return False
        cpu = time.thread_time()
        try:
            send()
        except Exception:
            log.exception("sending a response failed")
        self.cpu_s += time.thread_time() - cpu
        self.sent += 1
        return True


class TritonSink:
    """One request's sink: formats outputs per the request's flags, queues the sends, and tells
    ``stats`` when the first token went out and how the request ended (exactly once)."""

    def __init__(
        self,
        sender: Any,
        gen: GenerateRequest,
        thread: SenderThread,
        stats: InstanceStats,
        arrival: float,
    ) -> None:
        self.sender = sender
        self.gen = gen
        self.thread = thread
        self.stats = stats
        self.arrival = arrival
        self._text = gen.prompt if gen.prepend_prompt else ""
        self._first_at: float | None = None
        self._ended = False
        self._lock = threading.Lock()
        self._pending: RequestOutput | None = None
        """The newest output of a queued streamed send, ``_pending_text`` all text since the
        last one sent; both None/"" when no send is queued."""
        self._pending_text = ""

    def _end(self, error_kind: str | None) -> None:
        if not self._ended:
            self._ended = True
            self.stats.end(error_kind)

    def _put(self, response: Any, flags: int) -> None:
        sender = self.sender
        if response is None:
            self.thread.put(lambda: sender.send(flags=flags))
        else:
            self.thread.put(lambda: sender.send(response, flags=flags))

    def cancel(self) -> None:
        """End the request the client gave up on: an empty FINAL response."""
        self._put(None, FINAL)
        self._end("cancelled")

    def send(self, out: RequestOutput) -> None:
        if out.finish_reason == "cancelled":
            self.cancel()
            return
        now = time.monotonic()
        if self._first_at is None:
            self._first_at = now
            self.stats.first_token(self.arrival, now)
        if out.finished:
            self.stats.finished(self._first_at, now, out.num_output_tokens)
            self._end(None)
        if not self.gen.stream:
            self._text += out.new_text
            if out.finished:
                self._put(self._response(out, self._text), FINAL)
            return
        with self._lock:
            queued = self._pending is not None
            self._pending = out
            self._pending_text += out.new_text
        if not queued:
            self.thread.put(self._send_pending)

    def _send_pending(self) -> None:
        """On the sender thread: one response with the text of every output since the last."""
        with self._lock:
            out, text = self._pending, self._pending_text
            self._pending, self._pending_text = None, ""
        assert out is not None
        response = self._response(out, text)
        self.sender.send(response, flags=FINAL if out.finished else 0)

    def _response(self, out: RequestOutput, text: str) -> Any:
        tensors = [bytes_tensor("text_output", [text])]
        if out.finished:
            if self.gen.return_finish_reason:
                tensors.append(bytes_tensor("finish_reason", [out.finish_reason or ""]))
            if self.gen.return_num_input_tokens:
                tensors.append(
                    pb_utils.Tensor("num_input_tokens", np.array([out.num_prompt_tokens], np.int32))
                )
            if self.gen.return_num_output_tokens:
                tensors.append(
                    pb_utils.Tensor(
                        "num_output_tokens", np.array([out.num_output_tokens], np.int32)
                    )
                )
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def fail(self, message: str, kind: str) -> None:
        self._put(error_response(message, getattr(pb_utils.TritonError, ERROR_CODES[kind])), FINAL)
        self._end(kind)

    def cancelled(self) -> bool:
        return bool(self.sender.is_cancelled())
