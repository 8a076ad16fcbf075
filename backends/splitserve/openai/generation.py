"""Runs one request against Triton and answers it: one JSON body, or a stream of SSE chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from splitserve.openai.errors import APIError
from splitserve.openai.responses import Shape, finish_reason, usage
from splitserve.openai.sse import (
    DONE,
    ClientGone,
    EventStream,
    event,
    unless_disconnected,
)
from splitserve.openai.triton_bridge import Chunk, TritonBridge

CLIENT_CLOSED = 499
"""Status logged for a request whose client went away (nobody reads the answer)."""


@dataclass(frozen=True)
class Job:
    """One generation: the Triton model and inputs, and how to answer."""

    triton_model: str
    prompt: str
    sampling: dict[str, Any]
    shape: Shape
    stream: bool
    include_usage: bool = False
    prefix: str = ""
    """Text put before the generated text (``echo``)."""


async def answer(request: Request, bridge: TritonBridge, job: Job) -> Response:
    chunks = bridge.generate(job.triton_model, job.prompt, job.sampling, job.stream)
    try:
        if not job.stream:
            async with aclosing(chunks):
                return JSONResponse(await unless_disconnected(request.receive, _body(chunks, job)))
        # The first response decides the status: a request the model refuses is an HTTP error.
        first = await unless_disconnected(request.receive, anext(chunks))
    except ClientGone:
        await chunks.aclose()
        return Response(status_code=CLIENT_CLOSED)
    except BaseException:
        await chunks.aclose()
        raise
    return EventStream(_events(first, chunks, job))


async def _body(chunks: AsyncIterator[Chunk], job: Job) -> dict[str, Any]:
    parts = [job.prefix]
    async for chunk in chunks:
        parts.append(chunk.text)
        if chunk.final:
            return job.shape.body("".join(parts), finish_reason(chunk.finish_reason), _usage(chunk))
    raise APIError("no final response from Triton", 502)


async def _events(first: Chunk, chunks: AsyncIterator[Chunk], job: Job) -> AsyncIterator[str]:
    shape, with_usage = job.shape, job.include_usage
    async with aclosing(chunks):
        if shape.chat:
            yield event(shape.chunk(job.prefix, None, with_usage, role=True))
        elif job.prefix:
            yield event(shape.chunk(job.prefix, None, with_usage))
        chunk = first
        try:
            while True:
                reason = finish_reason(chunk.finish_reason) if chunk.final else None
                if chunk.text or chunk.final:
                    yield event(shape.chunk(chunk.text, reason, with_usage))
                if chunk.final:
                    break
                chunk = await anext(chunks)
        except APIError as exc:
            yield event(exc.body())
            yield DONE
            return
        if with_usage:
            yield event(shape.usage_chunk(_usage(chunk)))
        yield DONE


def _usage(final: Chunk) -> dict[str, int]:
    return usage(final.num_input_tokens or 0, final.num_output_tokens or 0)
