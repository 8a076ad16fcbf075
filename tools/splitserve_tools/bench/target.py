"""What a benchmark sends requests to: a Triton model over gRPC, or (lazily) an OpenAI endpoint."""

from __future__ import annotations

import importlib
from typing import Protocol

import tritonclient.grpc.aio as grpcaio

from splitserve_client.generate import GenerateArgs
from splitserve_client.stream import RequestRecord, stream_generate

OPENAI_PREFIX = "openai:"
OPENAI_MODULE = "splitserve_tools.bench.openai_target"


class Target(Protocol):
    """One served model. Requests are greedy and ignore EOS, so output lengths are exact."""

    name: str

    async def generate(self, prompt: str, max_tokens: int) -> RequestRecord:
        """Stream one completion of ``prompt``; the record holds the arrival time of each token
        (errors go in ``record.error``, they are not raised)."""
        ...

    async def close(self) -> None:
        """Release connections; no ``generate`` follows."""
        ...


class TritonTarget:
    """A Triton model (``llm``, ``llm_colocated``) over gRPC streaming; one shared aio client."""

    def __init__(self, url: str, model: str) -> None:
        self.name = model
        self.url = url
        self._client = grpcaio.InferenceServerClient(url)

    async def generate(self, prompt: str, max_tokens: int) -> RequestRecord:
        args = GenerateArgs(
            prompt=prompt, url=self.url, model=self.name, max_tokens=max_tokens, ignore_eos=True
        )
        return await stream_generate(self._client, args)

    async def close(self) -> None:
        await self._client.close()


def make_target(spec: str, url: str) -> Target:
    """``llm`` / ``llm_colocated`` (a Triton model at ``url``) or
    ``openai:http://host:port/v1@model`` (needs ``splitserve_tools.bench.openai_target``)."""
    if not spec.startswith(OPENAI_PREFIX):
        return TritonTarget(url, spec)
    base_url, sep, model = spec.removeprefix(OPENAI_PREFIX).rpartition("@")
    if not sep or not base_url or not model:
        raise ValueError(f"expected openai:http://host:port/v1@model, got {spec!r}")
    try:
        module = importlib.import_module(OPENAI_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != OPENAI_MODULE:
            raise
        raise RuntimeError(
            f"target {spec!r} needs {OPENAI_MODULE}, which is not installed in this checkout"
        ) from exc
    target: Target = module.OpenAITarget(base_url, model)
    return target
