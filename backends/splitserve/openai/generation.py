"""Runs one request against Triton and answers it: one JSON body, or a stream of SSE chunks.

A Triton stream silent for longer than the request's ``idle_timeout`` fails it (Triton leaves
the streams of a dead model instance open) and is cancelled.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from splitserve.openai.errors import APIError, triton_silent
from splitserve.openai.responses import Shape, finish_reason, usage
from splitserve.openai.sse import (
    DONE,
    ClientGone,
    EventStream,
    event,
    unless_disconnected,
)
from splitserve.openai.triton_bridge import Chunk, TritonBridge

log = logging.getLogger(__name__)

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
    idle_timeout: float | None = None
    """Seconds the Triton stream may stay silent before the request fails; None: no limit."""


async def answer(request: Request, bridge: TritonBridge, job: Job) -> Response:
    # With a deadline, a non-streaming request streams from Triton too and the text is joined
    # here: silence then means a stalled server, not a long answer.
    triton_stream = job.stream or job.idle_timeout is not None
    chunks = bridge.generate(job.triton_model, job.prompt, job.sampling, triton_stream)
    if job.idle_timeout is not None:
        chunks = _until_silent(chunks, job.idle_timeout)
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


async def _until_silent(
    chunks: AsyncGenerator[Chunk, None], idle_s: float
) -> AsyncGenerator[Chunk, None]:
    """``chunks``, until the next one takes over ``idle_s``: then the wait for it is cancelled,
    which closes the Triton stream and so cancels the request, and a 504 ``APIError`` is raised.
    """
    async with aclosing(chunks):
        while True:
            try:
                async with asyncio.timeout(idle_s):
                    chunk = await anext(chunks)
            except StopAsyncIteration:
                return
            except TimeoutError:
                log.warning("Triton stream silent for %g s; request cancelled", idle_s)
                raise triton_silent(idle_s) from None
            yield chunk


async def _body(chunks: AsyncGenerator[Chunk, None], job: Job) -> dict[str, Any]:
    parts = [job.prefix]
    async for chunk in chunks:
        parts.append(chunk.text)
        if chunk.final:
            return job.shape.body("".join(parts), finish_reason(chunk.finish_reason), _usage(chunk))
    raise APIError("no final response from Triton", 502)


async def _events(
    first: Chunk, chunks: AsyncGenerator[Chunk, None], job: Job
) -> AsyncIterator[str]:
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
