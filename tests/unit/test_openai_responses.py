"""Response bodies, stream chunks, SSE framing, error objects and the disconnect watch."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from splitserve.openai.errors import (
    APIError,
    from_triton_message,
    model_not_found,
    validation_message,
)
from splitserve.openai.responses import Shape, finish_reason, usage
from splitserve.openai.sse import DONE, ClientGone, event, unless_disconnected


def test_completion_shapes() -> None:
    shape = Shape("m", chat=False, id="cmpl-1", created=5)
    counts = usage(3, 4)
    assert counts == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert shape.body("out", "length", counts) == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 5,
        "model": "m",
        "choices": [{"index": 0, "logprobs": None, "finish_reason": "length", "text": "out"}],
        "usage": counts,
    }
    chunk = shape.chunk("t", None, include_usage=True)
    assert chunk["choices"][0]["text"] == "t" and chunk["usage"] is None
    assert "usage" not in shape.chunk("t", None, include_usage=False)
    assert shape.usage_chunk(counts)["choices"] == []


def test_chat_shapes() -> None:
    shape = Shape("m", chat=True)
    assert shape.id.startswith("chatcmpl-") and shape.created > 0
    body = shape.body("hi", "stop", usage(1, 1))
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    first = shape.chunk("", None, include_usage=False, role=True)
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert shape.chunk("x", "length", False)["choices"][0]["delta"] == {"content": "x"}
    assert shape.usage_chunk(usage(1, 2))["object"] == "chat.completion.chunk"


def test_finish_reasons() -> None:
    assert [finish_reason(r) for r in ("stop", "length", "eos", None, "")] == [
        "stop",
        "length",
        "stop",
        None,
        None,
    ]


def test_sse_framing() -> None:
    assert event({"a": "é"}) == 'data: {"a":"é"}\n\n'
    assert DONE == "data: [DONE]\n\n"


@pytest.mark.parametrize(
    ("message", "status"),
    [
        ("input 'text_input' must not be empty", 400),
        ("max_tokens 5000 plus the prompt's 3 tokens exceeds max_model_len 4096", 400),
        ("internal error: boom", 500),
        ("prefill failed: boom", 500),
        ("prefill KV pool is full: needs 3 blocks, 0 free", 503),
        ("server is shutting down", 503),
        ("Request for unknown model: 'x' is not found", 503),
    ],
)
def test_triton_errors(message: str, status: int) -> None:
    error = from_triton_message(message)
    assert (error.status, error.message) == (status, message)


def test_error_objects() -> None:
    body = model_not_found("gpt", ["mine"]).body()["error"]
    assert body["type"] == "invalid_request_error" and body["code"] == "model_not_found"
    assert body["param"] == "model" and "mine" in body["message"]
    types = [APIError("x", status).body()["error"]["type"] for status in (405, 500, 502, 503)]
    assert types == [
        "invalid_request_error",
        "server_error",
        "server_error",
        "service_unavailable_error",
    ]
    errors: list[dict[str, Any]] = [
        {"loc": ("body", "temperature"), "msg": "must be >= 0"},
        {"loc": ("body", "stop", "str"), "msg": "bad"},
    ]
    assert validation_message(errors) == ("temperature: must be >= 0; stop.str: bad", "temperature")
    assert validation_message([{"loc": ("body",), "msg": "JSON decode error"}]) == (
        "JSON decode error",
        None,
    )


def fake_receive(disconnect_after_s: float | None) -> Any:
    async def receive() -> dict[str, str]:
        if disconnect_after_s is None:
            await asyncio.Event().wait()
        await asyncio.sleep(disconnect_after_s or 0.0)
        return {"type": "http.disconnect"}

    return receive


def test_work_finishing_first_returns_its_result() -> None:
    async def work() -> int:
        await asyncio.sleep(0.01)
        return 7

    assert asyncio.run(unless_disconnected(fake_receive(None), work())) == 7


def test_work_error_propagates() -> None:
    async def work() -> None:
        raise APIError("bad", 400)

    with pytest.raises(APIError):
        asyncio.run(unless_disconnected(fake_receive(None), work()))


def test_disconnect_cancels_the_work() -> None:
    cleaned = asyncio.Event()

    async def work() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            cleaned.set()

    async def main() -> None:
        with pytest.raises(ClientGone):
            await unless_disconnected(fake_receive(0.01), work())
        assert cleaned.is_set()

    asyncio.run(main())
