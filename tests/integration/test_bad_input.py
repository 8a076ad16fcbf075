"""Bad requests end with INVALID_ARG naming the field; the server stays healthy afterwards.

HTTP shows the code (400). On a gRPC stream the wire carries only the error message, so there the
tests check the message (tritonclient hands the callback no status).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from llm_client import MAX_MODEL_LEN, GrpcStream, generate_inputs, is_ready, post

from splitserve.deploy.launcher import TritonServer

pytestmark = pytest.mark.triton

MODELS = ("llm", "llm_colocated")
LONG_PROMPT = "word " * MAX_MODEL_LEN
GOOD = {"temperature": 0.0, "max_tokens": 3, "ignore_eos": True}

# name -> (HTTP generate body, words the message must contain)
BAD_BODIES: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "missing-text_input": ({"max_tokens": 3}, ("text_input", "required")),
    "empty-prompt": ({"text_input": ""}, ("text_input", "empty")),
    "prompt-too-long": ({"text_input": LONG_PROMPT}, ("text_input", str(MAX_MODEL_LEN))),
    "max_tokens-0": ({"text_input": "hi", "max_tokens": 0}, ("max_tokens",)),
    "max_tokens-negative": ({"text_input": "hi", "max_tokens": -5}, ("max_tokens",)),
    "max_tokens-huge": ({"text_input": "hi", "max_tokens": 2**31 - 1}, ("max_tokens",)),
    "max_tokens-0-in-json": (
        {"text_input": "hi", "sampling_parameters": json.dumps({"max_tokens": 0})},
        ("max_tokens",),
    ),
    "bad-json": (
        {"text_input": "hi", "sampling_parameters": "{not json"},
        ("sampling_parameters",),
    ),
    "json-not-object": (
        {"text_input": "hi", "sampling_parameters": "[1]"},
        ("sampling_parameters",),
    ),
    "unknown-sampling-key": (
        {"text_input": "hi", "sampling_parameters": json.dumps({"best_temperature": 1})},
        ("sampling_parameters", "best_temperature"),
    ),
    "wrong-type-in-json": (
        {"text_input": "hi", "sampling_parameters": json.dumps({"temperature": "hot"})},
        ("temperature",),
    ),
    "beam-search": ({"text_input": "hi", "beam_width": 4}, ("beam_width",)),
    "seed-2**64-in-json": (
        {"text_input": "hi", "sampling_parameters": json.dumps({"seed": 2**64})},
        ("seed",),
    ),
    "seed-negative-in-json": (
        {"text_input": "hi", "sampling_parameters": json.dumps({"seed": -1})},
        ("seed",),
    ),
    "seed-negative": ({"text_input": "hi", "seed": -1}, ("seed",)),
    "timeout-0": ({"text_input": "hi", "sampling_parameters": '{"timeout": 0}'}, ("timeout",)),
    "timeout-negative": (
        {"text_input": "hi", "sampling_parameters": '{"timeout": -2.5}'},
        ("timeout",),
    ),
    "timeout-infinite": (
        {"text_input": "hi", "sampling_parameters": '{"timeout": Infinity}'},
        ("timeout",),
    ),
    "timeout-not-a-number": (
        {"text_input": "hi", "sampling_parameters": '{"timeout": "soon"}'},
        ("timeout",),
    ),
    "deadline_ms-fraction": (
        {"text_input": "hi", "sampling_parameters": '{"deadline_ms": 1.5}'},
        ("deadline_ms",),
    ),
    "deadline_ms-0": (
        {"text_input": "hi", "sampling_parameters": '{"deadline_ms": 0}'},
        ("deadline_ms",),
    ),
    "timeout-and-deadline_ms": (
        {"text_input": "hi", "sampling_parameters": '{"timeout": 1, "deadline_ms": 1000}'},
        ("timeout", "deadline_ms"),
    ),
}


NON_UTF8 = b"caf\xe9 \xff"
HTTP_BODIES: dict[str, tuple[bytes | dict[str, Any], tuple[str, ...]]] = {
    **BAD_BODIES,
    "non-utf8": (b'{"text_input": "' + NON_UTF8 + b'"}', ("text_input", "UTF-8")),
}
"""Wrong JSON types are missing: Triton's HTTP frontend answers them itself, with 500."""


def assert_healthy(server: TritonServer, model: str) -> None:
    assert is_ready(server)
    with GrpcStream(server.grpc_url) as client:
        got = client.generate(model, generate_inputs("still there?", stream=True, sampling=GOOD))
    assert got.num_output_tokens == GOOD["max_tokens"]


@pytest.mark.parametrize("case", list(HTTP_BODIES))
@pytest.mark.parametrize("model", MODELS)
def test_bad_http_request_is_400_naming_the_field(
    splitserve_server: TritonServer, model: str, case: str
) -> None:
    body, words = HTTP_BODIES[case]
    for endpoint in ("generate", "generate_stream"):
        status, text = post(splitserve_server, model, endpoint, body)
        assert status == 400, text
        message = json.loads(text.removeprefix("data: "))["error"]
        assert all(word in message for word in words), message
    assert_healthy(splitserve_server, model)


def grpc_case(case: str) -> tuple[Any, tuple[str, ...]]:
    """A gRPC request for ``case``: the HTTP body as tensors, or one HTTP cannot express."""
    if case == "non-utf8":
        return generate_inputs(NON_UTF8), ("text_input", "UTF-8")
    if case == "wrong-dtype":  # Triton checks the dtype before the model sees the request
        tensors = {"max_tokens": (np.array([3.0], np.float32), "FP32")}
        return generate_inputs("hi", tensors=tensors), ("max_tokens", "INT32")
    body, words = BAD_BODIES[case]
    tensors: dict[str, tuple[np.ndarray, str]] = {}
    for name, value in body.items():
        if name in ("max_tokens", "beam_width"):
            tensors[name] = (np.array([value], np.int32), "INT32")
        elif name == "seed":
            tensors[name] = (np.array([value], np.int64), "INT64")
        elif name == "sampling_parameters":
            tensors[name] = (np.array([value.encode()], np.object_), "BYTES")
    return generate_inputs(body.get("text_input"), tensors=tensors), words


@pytest.mark.parametrize("case", ["non-utf8", "wrong-dtype", *BAD_BODIES])
@pytest.mark.parametrize("model", MODELS)
def test_bad_grpc_request_fails_naming_the_field(
    splitserve_server: TritonServer, model: str, case: str
) -> None:
    inputs, words = grpc_case(case)
    with GrpcStream(splitserve_server.grpc_url) as client:
        message = client.error_of(model, inputs)
        assert all(word in message for word in words), message
        good = client.generate(model, generate_inputs("next", stream=True, sampling=GOOD))
        assert good.num_output_tokens == GOOD["max_tokens"]
        assert client.events.empty(), "the failed request sent more than its error"
    assert_healthy(splitserve_server, model)


@pytest.mark.parametrize(
    "seed",
    [{"sampling_parameters": json.dumps({"seed": 2**64 - 1})}, {"random_seed": 2**64 - 1}],
    ids=["json", "random_seed"],
)
def test_largest_seed_samples_alike_in_both_models(
    splitserve_server: TritonServer, seed: dict[str, Any]
) -> None:
    """The top of the seed range reaches the sampler intact, through prefill's BLS call too."""
    body = {"text_input": "hi", "max_tokens": 4, "temperature": 1.0, "ignore_eos": True, **seed}
    texts = []
    for model in MODELS:
        status, text = post(splitserve_server, model, "generate", body)
        assert status == 200, text
        texts.append(json.loads(text)["text_output"])
    assert texts[0] == texts[1]
