"""Greedy text through ``llm`` (disaggregated) and ``llm_colocated`` on a real tritonserver equals
the offline engine's and transformers', over every protocol, alone and 32 streams at once."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from llm_client import (
    Generation,
    GrpcStream,
    ReferenceFactory,
    generate_inputs,
    http_generation,
    post,
    sse_events,
)

from splitserve.deploy.launcher import TritonServer

pytestmark = pytest.mark.triton

MODELS = ("llm", "llm_colocated")
PROMPTS = (
    "The old lighthouse keeper climbed the spiral stairs",
    "def fibonacci(n: int) -> int:",
    "Café ☕ naïve — 東京",
)
MAX_TOKENS = 12
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}


def trtllm_tensors() -> dict[str, tuple[np.ndarray, str]]:
    """TensorRT-LLM-backend style: sampling as tensors, EOS stops."""
    return {
        "max_tokens": (np.array([MAX_TOKENS], np.int32), "INT32"),
        "temperature": (np.array([0.0], np.float32), "FP32"),
    }


def grpc_generate(
    server: TritonServer, model: str, prompt: str, *, stream: bool, json_params: bool
) -> Generation:
    inputs = generate_inputs(
        prompt,
        stream=stream,
        sampling=GREEDY if json_params else None,
        tensors=None if json_params else trtllm_tensors(),
    )
    if not stream:
        inputs += generate_inputs(
            None, tensors={"exclude_input_in_output": (np.array([True]), "BOOL")}
        )
    with GrpcStream(server.grpc_url) as client:
        return client.generate(model, inputs)


def http_generate(
    server: TritonServer, model: str, prompt: str, *, stream: bool, json_params: bool
) -> Generation:
    body: dict[str, Any] = {"text_input": prompt}
    if json_params:
        body["sampling_parameters"] = json.dumps(GREEDY)
    else:
        body.update(max_tokens=MAX_TOKENS, temperature=0.0)
    if stream:
        body["stream"] = True
    else:
        body["exclude_input_in_output"] = True
    status, text = post(server, model, "generate_stream" if stream else "generate", body)
    assert status == 200, text
    events = sse_events(text) if stream else [json.loads(text)]
    assert all("error" not in event for event in events), events
    if stream:
        assert len(events) > 1, "generate_stream sent the whole text at once"
    return http_generation(events)


PROTOCOLS = {
    "grpc-stream": (grpc_generate, True),
    "grpc": (grpc_generate, False),
    "http-generate": (http_generate, False),
    "http-generate-stream": (http_generate, True),
}


@pytest.mark.parametrize("json_params", [True, False], ids=["sampling-json", "trtllm-tensors"])
@pytest.mark.parametrize("protocol", list(PROTOCOLS))
@pytest.mark.parametrize("model", MODELS)
def test_greedy_text_equals_offline_engine_and_transformers(
    splitserve_server: TritonServer,
    greedy_reference: ReferenceFactory,
    model: str,
    protocol: str,
    json_params: bool,
) -> None:
    generate, stream = PROTOCOLS[protocol]
    for prompt in PROMPTS:
        ref = greedy_reference(prompt, MAX_TOKENS, json_params)
        got = generate(splitserve_server, model, prompt, stream=stream, json_params=json_params)
        assert got.text == ref.text, prompt
        assert got.num_output_tokens == len(ref.token_ids)
        assert got.num_input_tokens == len(ref.prompt_ids)
        expected_reason = "length" if len(ref.token_ids) == MAX_TOKENS else "stop"
        assert got.finish_reason == expected_reason
        if protocol == "grpc-stream":
            # A response per token, or fewer where the sender fell behind and joined tokens.
            assert got.finals[-1] and not any(got.finals[:-1])
            assert 1 <= len(got.finals) <= len(ref.token_ids)
        elif protocol == "grpc":
            assert got.finals == [True]


@pytest.mark.parametrize("model", MODELS)
def test_non_streaming_output_starts_with_the_prompt_unless_excluded(
    splitserve_server: TritonServer, greedy_reference: ReferenceFactory, model: str
) -> None:
    """vLLM-backend convention: a non-streamed response prepends the prompt by default."""
    prompt = PROMPTS[0]
    ref = greedy_reference(prompt, MAX_TOKENS, True)
    with GrpcStream(splitserve_server.grpc_url) as client:
        got = client.generate(model, generate_inputs(prompt, sampling=GREEDY))
    assert got.text == prompt + ref.text
    assert got.finals == [True]
    status, text = post(
        splitserve_server,
        model,
        "generate",
        {"text_input": prompt, "sampling_parameters": json.dumps(GREEDY)},
    )
    assert status == 200, text
    assert json.loads(text)["text_output"] == prompt + ref.text


def mixed_requests(count: int) -> list[tuple[str, dict[str, Any]]]:
    """Prompts from a few to a few hundred tokens, each with its own max_tokens."""
    words = (PROMPTS[0] + " " + PROMPTS[1] + " " + PROMPTS[2]).split()
    requests = []
    for i in range(count):
        length = 1 + (i * 37) % 150
        prompt = " ".join(words[j % len(words)] for j in range(i, i + length))
        params = {"temperature": 0.0, "max_tokens": 4 + (i * 7) % 29, "ignore_eos": True}
        requests.append((prompt, params))
    return requests


@pytest.mark.parametrize("model", MODELS)
def test_32_concurrent_streams_each_equal_their_solo_output(
    splitserve_server: TritonServer, model: str
) -> None:
    requests = mixed_requests(32)
    with GrpcStream(splitserve_server.grpc_url) as client:
        solo = [
            client.generate(model, generate_inputs(prompt, stream=True, sampling=params))
            for prompt, params in requests
        ]
    streams = [GrpcStream(splitserve_server.grpc_url) for _ in requests]
    try:
        for stream, (prompt, params) in zip(streams, requests, strict=True):
            stream.send(model, generate_inputs(prompt, stream=True, sampling=params))
        together = [stream.collect(timeout_s=60) for stream in streams]
    finally:
        for stream in streams:
            stream.close()
    for (_, params), alone, concurrent in zip(requests, solo, together, strict=True):
        assert alone.num_output_tokens == params["max_tokens"]
        # The same output; responses may differ in how many tokens each carries.
        assert replace(concurrent, finals=[]) == replace(alone, finals=[])
        assert concurrent.finals[-1] and not any(concurrent.finals[:-1])
