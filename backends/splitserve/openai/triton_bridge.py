"""Talks to the Triton generate models over gRPC (``tritonclient.grpc.aio``).

Each request is one bidirectional stream. Closing ``generate`` before its FINAL response (the
HTTP client went away) cancels the gRPC call: Triton then cancels the request, and the model
drops it and frees its KV blocks.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcaio
from grpc.aio import AioRpcError
from tritonclient.grpc import InferInput, InferResult
from tritonclient.utils import InferenceServerException

from splitserve.openai.errors import APIError, from_triton_message, triton_unavailable


@dataclass(frozen=True)
class Chunk:
    """One response of a generate model: new text, and on the FINAL one the request's totals."""

    text: str
    final: bool
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None


def generate_inputs(prompt: str, sampling: dict[str, Any], stream: bool) -> list[InferInput]:
    values = {
        "text_input": np.array([prompt.encode()], dtype=np.object_),
        "stream": np.array([stream]),
        "exclude_input_in_output": np.array([True]),
        "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=np.object_),
    }
    inputs = []
    for name, value in values.items():
        tensor = InferInput(name, list(value.shape), "BYTES" if value.dtype == object else "BOOL")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


def _first(result: InferResult, name: str) -> Any:
    array = result.as_numpy(name)
    if array is None or array.size == 0:
        return None
    value = array.reshape(-1)[0]
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else int(value)


def to_chunk(result: InferResult) -> Chunk:
    final = result.get_response().parameters.get("triton_final_response")
    text = result.as_numpy("text_output")
    chunk_text = (
        b"".join(text.reshape(-1)).decode("utf-8", errors="replace") if text is not None else ""
    )
    if final is None or not final.bool_param:
        return Chunk(chunk_text, final=False)
    return Chunk(
        chunk_text,
        final=True,
        finish_reason=_first(result, "finish_reason"),
        num_input_tokens=_first(result, "num_input_tokens"),
        num_output_tokens=_first(result, "num_output_tokens"),
    )


async def _single(payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    yield payload


LOCAL_SUBCHANNEL_POOL = ("grpc.use_local_subchannel_pool", 1)
"""Channel option: a connection of this channel's own, where gRPC would share one between
channels to the same address."""


class TritonBridge:
    def __init__(self, url: str, *, own_connection: bool = False) -> None:
        self.url = url
        channel_args = [LOCAL_SUBCHANNEL_POOL] if own_connection else None
        self._client = grpcaio.InferenceServerClient(url, channel_args=channel_args)

    async def generate(
        self, model: str, prompt: str, sampling: dict[str, Any], stream: bool
    ) -> AsyncGenerator[Chunk, None]:
        """Responses up to and including the FINAL one; an error response raises ``APIError``.

        Close it (``aclose``) when done: that cancels the request if it has not finished.
        """
        payload = {
            "model_name": model,
            "inputs": generate_inputs(prompt, sampling, stream),
            "enable_empty_final_response": True,
        }
        call = self._client.stream_infer(_single(payload))
        finished = False
        try:
            async for result, error in call:
                if error is not None:
                    finished = True
                    raise from_triton_message(error.message())
                chunk = to_chunk(result)
                finished = chunk.final
                yield chunk
                if finished:
                    return
        except AioRpcError as exc:
            finished = True
            raise self._rpc_error(exc) from None
        finally:
            if not finished:
                call.cancel()
        raise APIError(f"Triton ended the stream of model '{model}' without a final response", 502)

    async def model_parameters(self, model: str) -> dict[str, str]:
        """The ``parameters`` of a model's config (raises 503 when Triton or the model is not
        there)."""
        try:
            config = await self._client.get_model_config(model, as_json=True)
        except InferenceServerException as exc:
            raise triton_unavailable(self.url, exc.message()) from None
        params = config.get("config", {}).get("parameters", {})
        return {key: value.get("string_value", "") for key, value in params.items()}

    async def is_ready(self, model: str) -> bool:
        try:
            return bool(await self._client.is_model_ready(model))
        except InferenceServerException:
            return False

    async def close(self) -> None:
        await self._client.close()

    def _rpc_error(self, exc: AioRpcError) -> APIError:
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return triton_unavailable(self.url, exc.details() or exc.code().name)
        return from_triton_message(exc.details() or exc.code().name)
