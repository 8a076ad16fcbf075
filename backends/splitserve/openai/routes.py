"""The HTTP endpoints: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
``/health``."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from splitserve.openai.errors import model_not_found
from splitserve.openai.generation import Job, answer
from splitserve.openai.health import Readiness
from splitserve.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    ignored_fields,
)
from splitserve.openai.responses import Shape
from splitserve.openai.sampling import (
    chat_max_tokens,
    check_chat,
    completion_prompt,
    message_dicts,
    sampling_parameters,
)
from splitserve.openai.served_model import ServedModel
from splitserve.openai.triton_bridge import TritonBridge

log = logging.getLogger(__name__)
router = APIRouter()


def _served(request: Request) -> ServedModel:
    return request.app.state.served


def _bridge(request: Request) -> TritonBridge:
    return request.app.state.bridge


def _check_model(request: Request, body: SamplingFields) -> ServedModel:
    served = _served(request)
    if body.model != served.name:
        raise model_not_found(body.model, [served.name])
    warned: set[str] = request.app.state.ignored_fields
    new = [name for name in ignored_fields(body) if name not in warned]
    if new:
        warned.update(new)
        log.warning("ignoring request fields it does not support (warned once): %s", new)
    return served


def _model_card(served: ServedModel, created: int) -> dict[str, Any]:
    return {"id": served.name, "object": "model", "created": created, "owned_by": "splitserve"}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(_served(request), request.app.state.created)]}


@router.get("/v1/models/{model:path}")
async def get_model(model: str, request: Request) -> dict[str, Any]:
    served = _served(request)
    if model != served.name:
        raise model_not_found(model, [served.name])
    return _model_card(served, request.app.state.created)


@router.get("/health")
async def health(request: Request) -> Response:
    """Answered at once from the checks in the background (``health``), however busy."""
    readiness: Readiness = request.app.state.readiness
    return Response(
        status_code=HTTPStatus.OK if readiness.ready else HTTPStatus.SERVICE_UNAVAILABLE
    )


def _include_usage(body: SamplingFields) -> bool:
    return body.stream and body.stream_options is not None and body.stream_options.include_usage


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    served = _check_model(request, body)
    prompt = completion_prompt(body)
    job = Job(
        triton_model=served.triton_model,
        prompt=prompt,
        sampling=sampling_parameters(body, body.max_tokens),
        shape=Shape(served.name, chat=False),
        stream=body.stream,
        include_usage=_include_usage(body),
        idle_timeout=request.app.state.idle_timeout,
        prefix=prompt if body.echo else "",
    )
    return await answer(request, _bridge(request), job)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    served = _check_model(request, body)
    check_chat(body)
    info = await served.info()
    messages = message_dicts(body.messages)
    prompt = info.template.render(
        messages,
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        extra=body.chat_template_kwargs,
    )
    max_tokens = chat_max_tokens(body)
    if max_tokens is None:
        max_tokens = info.default_max_tokens(prompt)
    job = Job(
        triton_model=served.triton_model,
        prompt=prompt,
        sampling=sampling_parameters(body, max_tokens),
        shape=Shape(served.name, chat=True),
        stream=body.stream,
        include_usage=_include_usage(body),
        idle_timeout=request.app.state.idle_timeout,
    )
    return await answer(request, _bridge(request), job)
