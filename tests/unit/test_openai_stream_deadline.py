"""The OpenAI frontend's deadline on a silent Triton stream (``--stream-idle-timeout``): a stream
ends with an error event, a non-streaming request gets a 504, and the Triton request is
cancelled; a steady stream outlives the deadline; the flag reaches both commands."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from fastapi import FastAPI
from starlette.requests import Request
from tritonclient.grpc import service_pb2_grpc

from splitserve.cli import _frontend_beside, add_runtime_parsers
from splitserve.openai.app import create_app
from splitserve.openai.errors import APIError
from splitserve.openai.generation import Job, answer
from splitserve.openai.options import OpenAIOptions
from splitserve.openai.responses import Shape
from splitserve.openai.served_model import ServedModel
from splitserve.openai.triton_bridge import Chunk, TritonBridge

IDLE_S = 0.3
GAP_S = 0.02
"""Between the chunks of a steady stream: far below ``IDLE_S``."""


class FakeBridge:
    """Sends ``texts``, one every ``gap_s``, then a FINAL chunk, or with ``stall`` nothing more
    (what Triton does on the streams of a dead stub). Records the ``stream`` flag of each
    request and whether it was closed before its end (which cancels a Triton request)."""

    def __init__(self, *texts: str, stall: bool, gap_s: float = 0.0) -> None:
        self.texts, self.stall, self.gap_s = texts, stall, gap_s
        self.streams: list[bool] = []
        self.closed_early = False

    async def generate(
        self, model: str, prompt: str, sampling: dict[str, Any], stream: bool
    ) -> AsyncIterator[Chunk]:
        self.streams.append(stream)
        done = False
        try:
            for text in self.texts:
                await asyncio.sleep(self.gap_s)
                yield Chunk(text, final=False)
            if self.stall:
                await asyncio.Event().wait()
            done = True
            yield Chunk("", final=True, finish_reason="length", num_input_tokens=2)
        finally:
            self.closed_early = not done


def app_with(bridge: FakeBridge, idle_s: float) -> FastAPI:
    """The frontend's app with ``bridge`` in place of the Triton clients its lifespan makes."""
    options = OpenAIOptions(served_model_name="m", stream_idle_timeout=idle_s)
    app = create_app(options)
    app.state.bridge = bridge
    app.state.served = ServedModel(options, bridge)  # type: ignore[arg-type]
    app.state.created = 0
    app.state.ignored_fields = set()
    return app


async def _stays() -> dict[str, Any]:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def http_scope(path: str) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 9000),
    }


def post(app: FastAPI, body: dict[str, Any]) -> tuple[int, bytes]:
    """POST ``body`` to ``/v1/completions`` by a client that stays; the status and the body."""
    request = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return request.pop() if request else await _stays()

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(asyncio.wait_for(app(http_scope("/v1/completions"), receive, send), 10))
    (status,) = [m["status"] for m in sent if m["type"] == "http.response.start"]
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def events(body: bytes) -> list[Any]:
    lines = [line for line in body.decode().split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [line.removeprefix("data: ") for line in lines]


def assert_timeout_error(error: dict[str, Any]) -> None:
    assert error["type"] == "server_error" and error["code"] == "triton_timeout", error
    assert "cancelled" in error["message"]


REQUEST = {"model": "m", "prompt": "p", "max_tokens": 8}


def test_a_silent_stream_ends_with_an_error_event_and_is_cancelled() -> None:
    bridge = FakeBridge("a", "b", stall=True)
    status, body = post(app_with(bridge, IDLE_S), {**REQUEST, "stream": True})
    assert status == 200
    *chunks, error, done = events(body)
    assert [json.loads(c)["choices"][0]["text"] for c in chunks] == ["a", "b"]
    assert_timeout_error(json.loads(error)["error"])
    assert done == "[DONE]"  # as after any error once a stream has started
    assert bridge.closed_early


@pytest.mark.parametrize(("stream", "texts"), [(False, ["a"]), (True, [])])
def test_silence_before_the_answer_is_a_504(stream: bool, texts: list[str]) -> None:
    """Non-streaming requests, and streams whose first response never came: an HTTP error."""
    bridge = FakeBridge(*texts, stall=True)
    status, body = post(app_with(bridge, IDLE_S), {**REQUEST, "stream": stream})
    assert status == 504
    assert_timeout_error(json.loads(body)["error"])
    assert bridge.closed_early
    assert bridge.streams == [True]  # with a deadline, Triton streams non-streaming ones too


@pytest.mark.parametrize("stream", [False, True])
def test_a_steady_stream_outlives_the_deadline(stream: bool) -> None:
    texts = [str(i % 10) for i in range(int(2 * IDLE_S / GAP_S))]
    bridge = FakeBridge(*texts, stall=False, gap_s=GAP_S)
    status, body = post(app_with(bridge, IDLE_S), {**REQUEST, "stream": stream})
    assert status == 200 and not bridge.closed_early
    if stream:
        *chunks, done = events(body)
        text = "".join(json.loads(c)["choices"][0]["text"] for c in chunks)
        assert done == "[DONE]"
    else:
        text = json.loads(body)["choices"][0]["text"]
    assert text == "".join(texts)


def test_without_a_deadline_non_streaming_requests_are_not_streamed_from_triton() -> None:
    bridge = FakeBridge("a", "b", stall=False)
    status, body = post(app_with(bridge, 0), REQUEST)
    assert status == 200 and json.loads(body)["choices"][0]["text"] == "ab"
    assert bridge.streams == [False]


class SilentTriton(service_pb2_grpc.GRPCInferenceServiceServicer):
    """A Triton stand-in that takes a stream's request and never answers it."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    async def ModelStreamInfer(self, request_iterator: Any, context: Any) -> None:
        await anext(aiter(request_iterator))
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:  # how grpc.aio tells a handler its call was cancelled
            self.cancelled.set()
            raise


def test_the_deadline_cancels_the_grpc_call() -> None:
    """The real Triton client: the stand-in sees its call cancelled once the deadline passed."""

    async def run() -> APIError:
        triton = SilentTriton()
        server = grpc.aio.server()
        service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(triton, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        bridge = TritonBridge(f"127.0.0.1:{port}")
        job = Job("llm", "p", {}, Shape("m", chat=False), stream=False, idle_timeout=IDLE_S)
        try:
            with pytest.raises(APIError) as info:
                request = Request(http_scope("/v1/completions"), _stays)
                await asyncio.wait_for(answer(request, bridge, job), 10)
            await asyncio.wait_for(triton.cancelled.wait(), 5)
        finally:
            await bridge.close()
            await server.stop(None)
        return info.value

    assert asyncio.run(run()).status == 504


def parse(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_runtime_parsers(ap.add_subparsers())
    return ap.parse_args(argv)


def test_the_flag_reaches_both_commands() -> None:
    from splitserve.openai.options import options_from_args

    assert options_from_args(parse("openai")).stream_idle_timeout == 60
    assert (
        options_from_args(parse("openai", "--stream-idle-timeout", "2.5")).stream_idle_timeout
        == 2.5
    )
    args = parse("serve", "--model", "tiny", "--openai-port", "9000", "--stream-idle-timeout", "0")
    assert _frontend_beside(args).stream_idle_timeout == 0
    assert create_app(_frontend_beside(args)).state.idle_timeout is None
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            parse("openai", "--stream-idle-timeout", bad)
