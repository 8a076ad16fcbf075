"""The FastAPI application: routes, OpenAI-style error answers, the Triton clients, the
readiness checks behind ``/health``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from splitserve.openai.errors import APIError, validation_message
from splitserve.openai.health import Readiness
from splitserve.openai.options import OpenAIOptions
from splitserve.openai.routes import router
from splitserve.openai.served_model import ServedModel
from splitserve.openai.triton_bridge import TritonBridge


def _error(exc: APIError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _api_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return _error(exc)


async def _invalid(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    message, param = validation_message(list(exc.errors()))
    return _error(APIError(message, HTTPStatus.BAD_REQUEST, param=param))


async def _http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return _error(APIError(str(exc.detail), exc.status_code))


async def _unexpected(_: Request, exc: Exception) -> Response:
    return _error(APIError(f"internal error: {exc}", HTTPStatus.INTERNAL_SERVER_ERROR))


def create_app(options: OpenAIOptions) -> FastAPI:
    """An app serving ``options.model_name`` from the Triton model at ``options.triton_url``."""

    readiness = Readiness()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The gRPC clients belong to the server's event loop, so they are made here. The
        # readiness checks have a connection of their own: they never queue behind the streams.
        bridge = TritonBridge(options.triton_url)
        checks = TritonBridge(options.triton_url, own_connection=True)
        app.state.bridge = bridge
        app.state.served = ServedModel(options, bridge)
        app.state.created = int(time.time())
        app.state.ignored_fields = set()

        def probe() -> Awaitable[bool]:
            return checks.is_ready(options.triton_model)

        await readiness.check(probe)  # /health is right from the first request
        watch = asyncio.create_task(readiness.watch(probe), name="triton-readiness")
        try:
            yield
        finally:
            readiness.shutting_down()
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
            await checks.close()
            await bridge.close()

    app = FastAPI(title="Splitserve OpenAI-compatible API", lifespan=lifespan)
    app.state.readiness = readiness
    app.state.idle_timeout = options.stream_idle_timeout or None
    app.include_router(router)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    return app
