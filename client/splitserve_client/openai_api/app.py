"""The FastAPI application: routes, OpenAI-style error answers, one Triton client."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

from splitserve_client.openai_api.errors import APIError, validation_message
from splitserve_client.openai_api.options import OpenAIOptions
from splitserve_client.openai_api.routes import router
from splitserve_client.openai_api.served import ServedModel
from splitserve_client.openai_api.triton_bridge import TritonBridge


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

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The gRPC client belongs to the server's event loop, so it is made here.
        bridge = TritonBridge(options.triton_url)
        app.state.bridge = bridge
        app.state.served = ServedModel(options, bridge)
        app.state.created = int(time.time())
        app.state.ignored_fields = set()
        try:
            yield
        finally:
            await bridge.close()

    app = FastAPI(title="Splitserve OpenAI-compatible API", lifespan=lifespan)
    app.include_router(router)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
    return app
