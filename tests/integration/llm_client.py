"""Test clients for the generate models: gRPC streams, HTTP generate[_stream], /metrics gauges;
and the servers and processes they talk to."""

from __future__ import annotations

import contextlib
import json
import queue
import re
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from splitserve.deploy.launcher import TritonInstall, TritonServer, free_ports
from splitserve.testing.procfs import stub_instances
from splitserve.transport import cleanup

Event = tuple[grpcclient.InferResult | None, InferenceServerException | None]
Tensors = Mapping[str, tuple[np.ndarray, str]]
"""Extra request inputs: name -> (array, Triton datatype)."""

# Settings of the session's splitserve server (conftest.splitserve_server).
MAX_MODEL_LEN = 4096
"""Long enough that a stream the tests cancel would otherwise run for seconds."""
SERVE_ENGINE = {"max_model_len": MAX_MODEL_LEN, "num_kv_blocks": 1024}
LEASE_TTL_S = 2.0
"""Prefill's lease lifetime in the splitserve server, short so that an unpulled lease expires
within a test."""

GAUGE_LINE = re.compile(r"^(splitserve_\w+)\{([^}]*)\} (\S+)$", re.M)
LABEL = re.compile(r'(\w+)="([^"]*)"')


def splitserve_triton(
    repo: Path,
    workdir: Path,
    install: TritonInstall,
    env: Mapping[str, str] | None = None,
    server_cores: set[int] | None = None,
) -> TritonServer:
    """An unstarted server of a rendered Splitserve repository on free ports."""
    http_port, grpc_port, metrics_port = free_ports(3)
    return TritonServer(
        repo,
        http_port=http_port,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        # Each pending BLS call to prefill holds one of these threads (default 32).
        backend_config={"python": {"thread-pool-size": 64}},
        workdir=workdir,
        install=install,
        env=env,
        server_cores=server_cores,
    )


def answers_200(url: str) -> bool:
    """Whether ``url`` answers 200 now (readiness probes)."""
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return response.status == 200
    except OSError:
        return False


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout_s`` (and raise then)."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


def http_generate(http_url: str, model: str) -> dict[str, Any]:
    """One greedy 4-token request to ``model``'s HTTP generate endpoint."""
    body = {"text_input": "Hello", "max_tokens": 4, "ignore_eos": True, "temperature": 0.0}
    request = urllib.request.Request(
        f"{http_url}/v2/models/{model}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@dataclass(frozen=True)
class Reference:
    """Greedy output of the offline engine, checked against transformers token for token."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str


ReferenceFactory = Callable[[str, int, bool], Reference]
"""``reference(prompt, max_tokens, ignore_eos)``"""


@dataclass
class Generation:
    """What one request returned: concatenated text and the last response's extras."""

    text: str = ""
    finals: list[bool] = field(default_factory=list)
    """``triton_final_response`` of every response, in order."""
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    finish_reason: str | None = None


def generate_inputs(
    prompt: str | bytes | None,
    *,
    stream: bool | None = None,
    sampling: Mapping[str, Any] | None = None,
    tensors: Tensors | None = None,
) -> list[grpcclient.InferInput]:
    arrays: dict[str, tuple[np.ndarray, str]] = {}
    if prompt is not None:
        data = prompt.encode() if isinstance(prompt, str) else prompt
        arrays["text_input"] = (np.array([data], dtype=np.object_), "BYTES")
    if stream is not None:
        arrays["stream"] = (np.array([stream]), "BOOL")
    if sampling is not None:
        arrays["sampling_parameters"] = (
            np.array([json.dumps(sampling).encode()], np.object_),
            "BYTES",
        )
    arrays.update(tensors or {})
    return infer_inputs(arrays)


def infer_inputs(tensors: Tensors) -> list[grpcclient.InferInput]:
    inputs = []
    for name, (array, datatype) in tensors.items():
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _first(result: grpcclient.InferResult, name: str) -> Any:
    """The output's first element as a Python value (bytes for BYTES), None if absent."""
    array = result.as_numpy(name)
    if array is None:
        return None
    value = array.reshape(-1)[0]
    return value.item() if isinstance(value, np.generic) else value


INVALID_STREAM = "no longer in valid state"
"""In what ``async_stream_infer`` raises once the stream's gRPC call has ended (tritonclient's
``_InferStream._enqueue_request``); the request was not queued."""


def ended_call(error: InferenceServerException | None) -> bool:
    """Whether ``error`` ended the stream's gRPC call itself (a dead server, a reset connection, a
    cancel: it carries a gRPC status) rather than answering one request on a live call."""
    return error is not None and error.status() is not None


@dataclass
class _Call:
    """One ``start_stream`` of the client: its requests not yet ended, and the error that ended
    the call, once one has."""

    pending: int = 0
    ended: InferenceServerException | None = None


class GrpcStream:
    """A gRPC bidirectional stream whose callback events land in a queue.

    The stream outlives its gRPC call: once the call has ended (tritonserver died, a connection
    was reset; whether the callback, ``start_stream`` or ``async_stream_infer`` reports it), it is
    discarded and a fresh call carries the next request. No request is sent twice unseen:

    - a request that ``async_stream_infer`` did not queue (the call had ended) never left the
      client: it is sent again, once, on a fresh call; if that call has ended too (no server
      there), the request's one event is that call's error;
    - a queued request may have reached the server: it is never sent again; if the call ends
      before its FINAL response or its error, the call's error is its last event (``ended_call``
      tells it apart), and the caller decides whether to send it again;
    - an error that ends a call with no request in flight answers none: it is dropped.

    Send requests through :meth:`send`, which counts them: one queued on ``client`` directly is
    neither sent again nor given the error that ends its call.
    """

    def __init__(self, url: str) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.events: queue.Queue[Event] = queue.Queue()
        # Held around queueing a request and in the callback, so that the error ending a call is
        # given to a request that was queued on it and never to one that was not.
        self._lock = threading.Lock()
        self._call = self._start()

    def _start(self) -> _Call:
        """Open a fresh call; a second time if ``start_stream`` fails (nothing was sent)."""
        call = _Call()
        try:
            self.client.start_stream(callback=partial(self._on_event, call))
        except InferenceServerException:
            self._stop(cancel=True)  # tritonclient keeps the stream it failed to start
            self.client.start_stream(callback=partial(self._on_event, call))
        return call

    def _stop(self, cancel: bool) -> None:
        """Stop the client's stream; once it returns, every event of the call has been seen."""
        # A call being discarded may fail to stop; it is gone either way.
        with contextlib.suppress(InferenceServerException):
            self.client.stop_stream(cancel_requests=cancel)

    def _on_event(
        self,
        call: _Call,
        result: grpcclient.InferResult | None,
        error: InferenceServerException | None,
    ) -> None:
        with self._lock:
            if ended_call(error):
                call.ended = error
                for _ in range(call.pending):  # the last event of each request in flight
                    self.events.put((None, error))
                call.pending = 0
                return
            if error is not None or (result is not None and is_final(result)):
                call.pending = max(call.pending - 1, 0)
            self.events.put((result, error))

    def send(self, model: str, inputs: list[grpcclient.InferInput], **options: Any) -> None:
        """Queue a request (``options``: ``async_stream_infer``'s keywords), on a fresh call if
        this one has ended (see the class docstring)."""
        not_queued: InferenceServerException | None = None
        for attempt in range(2):
            call = self._call
            with self._lock:
                if call.ended is None:
                    try:
                        self.client.async_stream_infer(model, inputs, **options)
                    except InferenceServerException as exc:
                        if INVALID_STREAM not in exc.message():
                            raise
                        not_queued = exc
                    else:
                        call.pending += 1
                        return
            # The call has ended and the request is not on it: discard the call (this joins its
            # reader, so ``call.ended`` is set) and try a fresh one, once.
            self._stop(cancel=True)
            if attempt == 0:
                self._call = self._start()
        # Neither call took it: the request fails with the error that ended the last one.
        self.events.put((None, call.ended or not_queued))

    def next(self, timeout_s: float = 30.0) -> Event:
        return self.events.get(timeout=timeout_s)

    def collect(self, timeout_s: float = 30.0) -> Generation:
        """Read one request's responses up to the FINAL one; raise its error if it failed."""
        gen = Generation()
        while not gen.finals or not gen.finals[-1]:
            result, error = self.next(timeout_s)
            if error is not None:
                raise error
            assert result is not None
            gen.finals.append(is_final(result))
            gen.text += _first(result, "text_output").decode()
            if gen.finals[-1]:
                gen.num_input_tokens = _first(result, "num_input_tokens")
                gen.num_output_tokens = _first(result, "num_output_tokens")
                reason = _first(result, "finish_reason")
                gen.finish_reason = None if reason is None else reason.decode()
        return gen

    def generate(self, model: str, inputs: list[grpcclient.InferInput]) -> Generation:
        self.send(model, inputs)
        return self.collect()

    def failure(self, model: str, inputs: list[grpcclient.InferInput]) -> InferenceServerException:
        """Send a request that must fail; its error (``ended_call`` if no server answered it)."""
        self.send(model, inputs)
        result, error = self.next()
        assert result is None, f"expected an error, got {result.get_response()}"
        assert error is not None
        return error

    def error_of(self, model: str, inputs: list[grpcclient.InferInput]) -> str:
        """Send a request that must fail; its error message (tritonclient drops the code)."""
        return self.failure(model, inputs).message()

    def close(self, cancel: bool = False) -> None:
        try:
            self._stop(cancel)
        finally:
            self.client.close()

    def __enter__(self) -> GrpcStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(cancel=exc_type is not None)


def is_final(result: grpcclient.InferResult) -> bool:
    return result.get_response().parameters["triton_final_response"].bool_param


def post(
    server: TritonServer, model: str, endpoint: str, body: bytes | dict[str, Any]
) -> tuple[int, str]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{server.http_url}/v2/models/{model}/{endpoint}",
        data=data,
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def sse_events(body: str) -> list[dict[str, Any]]:
    return [json.loads(line.removeprefix("data: ")) for line in body.splitlines() if line]


def http_generation(events: list[dict[str, Any]]) -> Generation:
    """Concatenate ``generate``'s one response or ``generate_stream``'s events."""
    last = events[-1]
    return Generation(
        text="".join(event["text_output"] for event in events),
        num_input_tokens=last.get("num_input_tokens"),
        num_output_tokens=last.get("num_output_tokens"),
        finish_reason=last.get("finish_reason"),
    )


def is_ready(server: TritonServer) -> bool:
    try:
        with urllib.request.urlopen(f"{server.http_url}/v2/health/ready", timeout=5) as response:
            return response.status == 200
    except urllib.error.URLError:
        return False


def gauges(server: TritonServer) -> dict[tuple[str, str], float]:
    """Every ``splitserve_*`` gauge on the metrics port, keyed by (name, model), summed over
    instances."""
    with urllib.request.urlopen(server.metrics_url, timeout=5) as response:
        text = response.read().decode()
    values: dict[tuple[str, str], float] = {}
    for name, labels, value in GAUGE_LINE.findall(text):
        key = (name, dict(LABEL.findall(labels))["model"])
        values[key] = values.get(key, 0.0) + float(value)
    return values


def wait_for(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)


def samples(server: TritonServer) -> list[tuple[str, dict[str, str], float]]:
    """Every ``splitserve_*`` sample on the metrics port: (name, labels, value)."""
    with urllib.request.urlopen(server.metrics_url, timeout=5) as response:
        text = response.read().decode()
    return [
        (name, dict(LABEL.findall(labels)), float(value))
        for name, labels, value in GAUGE_LINE.findall(text)
    ]


def stub_pid(server: TritonServer, instance: str) -> int:
    """Pid of the Python backend stub serving ``instance`` (e.g. ``llm_0_0``)."""
    assert server.pid is not None
    return stub_instances(server.pid)[instance]


def owned_files(pids: list[int]) -> list[Path]:
    """KV segments and release sockets made by the processes ``pids`` (see transport.cleanup)."""
    dirs = (Path("/dev/shm"), Path(tempfile.gettempdir()))
    owners = [cleanup.owned_name("*", pid=pid) for pid in pids]
    return [path for owner in owners for d in dirs for path in d.glob(owner)]
