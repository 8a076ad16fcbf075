"""Client cancellation frees every KV block; ``prefill`` called directly refuses anyone without
the server's key and garbage, and a lease nobody pulls is freed after expiry. Block and lease
counts come from the metrics port."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from llm_client import (
    LEASE_TTL_S,
    MAX_MODEL_LEN,
    GrpcStream,
    ReferenceFactory,
    gauges,
    generate_inputs,
    infer_inputs,
    wait_for,
)
from tritonclient.utils import InferenceServerException

from splitserve.deploy.launcher import TritonServer
from splitserve.engine_config import EngineConfig
from splitserve.serving import bls_contract
from splitserve.transport.key import generate_key

pytestmark = pytest.mark.triton

MODELS = ("llm", "llm_colocated")
POOLS = ("llm", "prefill", "llm_colocated")
BLOCK_SIZE = EngineConfig().block_size
CANCEL_STOP_S = 2.0
"""How soon a cancelled request must be gone; running to its end would take several times this."""
IDLE_S = LEASE_TTL_S + 5.0
"""How long to wait for the server to go idle: leases of earlier tests may still have to expire."""


def is_idle(server: TritonServer) -> bool:
    values = gauges(server)
    return (
        all(values[("splitserve_kv_blocks_used", pool)] == 0 for pool in POOLS)
        and values[("splitserve_leases_outstanding", "prefill")] == 0
        and all(values[("splitserve_requests_active", model)] == 0 for model in MODELS)
    )


def is_running(server: TritonServer, model: str) -> bool:
    values = gauges(server)
    return (
        values[("splitserve_requests_active", model)] == 1
        and values[("splitserve_kv_blocks_used", model)] > 0
    )


@pytest.mark.parametrize("model", MODELS)
def test_cancelled_stream_stops_and_frees_every_block(
    splitserve_server: TritonServer, model: str
) -> None:
    assert wait_for(lambda: is_idle(splitserve_server), IDLE_S), gauges(splitserve_server)
    prompt = "The old lighthouse keeper"
    sampling = {"temperature": 0.0, "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True}
    stream = GrpcStream(splitserve_server.grpc_url)
    try:
        stream.send(model, generate_inputs(prompt, stream=True, sampling=sampling))
        for _ in range(3):
            result, error = stream.next()
            assert error is None, error
            assert result is not None
        assert wait_for(lambda: is_running(splitserve_server, model), CANCEL_STOP_S)
    finally:
        stream.close(cancel=True)
    assert wait_for(lambda: is_idle(splitserve_server), CANCEL_STOP_S), gauges(splitserve_server)
    with GrpcStream(splitserve_server.grpc_url) as client:
        after = client.generate(
            model, generate_inputs(prompt, stream=True, sampling={"max_tokens": 2})
        )
    assert after.num_output_tokens == 2


def prefill_inputs(
    ids: np.ndarray, sampling: bytes, request_id: bytes = b"direct", seed: int = 7
) -> list[grpcclient.InferInput]:
    """``prefill``'s inputs as ``llm`` sends them: one request of batch size 1."""
    return infer_inputs(
        {
            "input_ids": (ids, "INT64" if ids.dtype == np.int64 else "INT32"),
            "sampling_parameters": (np.array([[sampling]], np.object_), "BYTES"),
            "seed": (np.array([[seed]], np.uint64), "UINT64"),
            "request_id": (np.array([[request_id]], np.object_), "BYTES"),
        }
    )


NOT_YOURS = "prefill is internal"
"""In the one error ``prefill`` gives a caller without a valid tag."""
GREEDY_ONE = json.dumps({"temperature": 0.0, "max_tokens": 1}).encode()
IDS = np.array([[1, 450, 2362, 9]], np.int64)
GARBAGE: dict[str, tuple[list[grpcclient.InferInput], tuple[str, ...]]] = {
    "empty-prompt": (prefill_inputs(np.zeros((1, 0), np.int64), GREEDY_ONE), ("prompt", "empty")),
    "token-out-of-vocab": (
        prefill_inputs(np.array([[5, 99999]], np.int64), GREEDY_ONE),
        ("token ids",),
    ),
    "prompt-too-long": (
        prefill_inputs(np.ones((1, MAX_MODEL_LEN), np.int64), GREEDY_ONE),
        ("max_model_len",),
    ),
    "bad-json": (prefill_inputs(IDS, b"{not json"), ("sampling_parameters", "JSON")),
    "json-not-object": (prefill_inputs(IDS, b"[1, 2]"), ("sampling_parameters",)),
    "unknown-key": (prefill_inputs(IDS, b'{"kv_handle": 1}'), ("sampling_parameters", "kv_handle")),
    "bad-value": (prefill_inputs(IDS, b'{"max_tokens": 0}'), ("max_tokens",)),
    # No tag can be checked against an unreadable request id: the same error as a bad tag.
    "non-utf8-request-id": (prefill_inputs(IDS, GREEDY_ONE, b"\xff\xfe"), (NOT_YOURS,)),
    "wrong-dtype": (prefill_inputs(IDS.astype(np.int32), GREEDY_ONE), ("input_ids", "INT64")),
    "batch-of-two": (
        infer_inputs(
            {
                "input_ids": (np.repeat(IDS, 2, axis=0), "INT64"),
                "sampling_parameters": (np.array([[GREEDY_ONE]] * 2, np.object_), "BYTES"),
                "seed": (np.array([[1], [2]], np.uint64), "UINT64"),
                "request_id": (np.array([[b"a"], [b"b"]], np.object_), "BYTES"),
            }
        ),
        (NOT_YOURS,),
    ),
    "missing-seed": (
        [t for t in prefill_inputs(IDS, GREEDY_ONE) if t.name() != "seed"],
        ("seed",),
    ),
}


def auth(key: bytes, request_id: str = "direct") -> dict[str, str]:
    """The request parameters ``llm`` sends with a call to ``prefill``."""
    return {bls_contract.AUTH: bls_contract.auth_tag(key, request_id)}


def test_prefill_refuses_garbage_without_leasing_blocks(
    splitserve_server: TritonServer, handle_key: bytes
) -> None:
    assert wait_for(lambda: is_idle(splitserve_server), IDLE_S), gauges(splitserve_server)
    with grpcclient.InferenceServerClient(splitserve_server.grpc_url) as client:
        for case, (inputs, words) in GARBAGE.items():
            with pytest.raises(InferenceServerException) as info:
                client.infer("prefill", inputs, parameters=auth(handle_key))
            assert info.value.status() == "StatusCode.INVALID_ARGUMENT", (case, info.value)
            message = info.value.message()
            assert all(word in message for word in words), (case, message)
    assert is_idle(splitserve_server), gauges(splitserve_server)


@pytest.mark.parametrize(
    "parameters",
    [None, {bls_contract.AUTH: "00" * 32}, {bls_contract.AUTH: 7}, "other-request", "other-key"],
    ids=["none", "forged", "not-a-string", "other-request", "other-key"],
)
def test_prefill_called_without_llms_key_gives_nothing(
    splitserve_server: TritonServer, handle_key: bytes, parameters: object
) -> None:
    if parameters == "other-request":
        parameters = auth(handle_key, "another")
    elif parameters == "other-key":
        parameters = auth(generate_key())
    assert wait_for(lambda: is_idle(splitserve_server), IDLE_S), gauges(splitserve_server)
    with (
        grpcclient.InferenceServerClient(splitserve_server.grpc_url) as client,
        pytest.raises(InferenceServerException) as info,
    ):
        client.infer("prefill", prefill_inputs(IDS, GREEDY_ONE), parameters=parameters)
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT", info.value
    assert NOT_YOURS in info.value.message()
    assert is_idle(splitserve_server), gauges(splitserve_server)


TRITON_CHECKS = ("wrong-dtype", "missing-seed")
"""Garbage that Triton itself answers from the model's config, before the model sees the call."""


@pytest.mark.parametrize(
    "parameters",
    [None, {bls_contract.AUTH: "00" * 32}, "other-key"],
    ids=["none", "forged", "other-key"],
)
def test_prefill_checks_the_tag_before_its_inputs(
    splitserve_server: TritonServer, parameters: object
) -> None:
    """A caller without a valid tag learns nothing about its inputs: one error text for all."""
    if parameters == "other-key":
        parameters = auth(generate_key())
    assert wait_for(lambda: is_idle(splitserve_server), IDLE_S), gauges(splitserve_server)
    messages = set()
    with grpcclient.InferenceServerClient(splitserve_server.grpc_url) as client:
        for case, (inputs, _) in GARBAGE.items():
            if case in TRITON_CHECKS:
                continue
            with pytest.raises(InferenceServerException) as info:
                client.infer("prefill", inputs, parameters=parameters)
            assert info.value.status() == "StatusCode.INVALID_ARGUMENT", (case, info.value)
            messages.add(info.value.message())
    assert len(messages) == 1 and NOT_YOURS in messages.pop(), messages
    assert is_idle(splitserve_server), gauges(splitserve_server)


def test_unpulled_lease_is_freed_after_expiry(
    splitserve_server: TritonServer, greedy_reference: ReferenceFactory, handle_key: bytes
) -> None:
    assert wait_for(lambda: is_idle(splitserve_server), IDLE_S), gauges(splitserve_server)
    ref = greedy_reference("The old lighthouse keeper", 1, True)
    ids = np.array([ref.prompt_ids], np.int64)
    sent = time.monotonic()
    with grpcclient.InferenceServerClient(splitserve_server.grpc_url) as client:
        result = client.infer(
            "prefill", prefill_inputs(ids, GREEDY_ONE), parameters=auth(handle_key)
        )
    assert result.as_numpy("first_token").reshape(-1).tolist() == ref.token_ids
    handle = result.as_numpy("kv_handle")
    assert handle.dtype == np.uint8 and handle.size > 0
    blocks = -(-len(ref.prompt_ids) // BLOCK_SIZE)

    def prefill_gauges() -> tuple[float, float]:
        values = gauges(splitserve_server)
        used = values[("splitserve_kv_blocks_used", "prefill")]
        return values[("splitserve_leases_outstanding", "prefill")], used

    assert wait_for(lambda: prefill_gauges() == (1, blocks), LEASE_TTL_S / 2), prefill_gauges()
    assert wait_for(lambda: prefill_gauges() == (0, 0), LEASE_TTL_S + 3.0), prefill_gauges()
    assert time.monotonic() - sent >= LEASE_TTL_S * 0.9, "the lease ended before it expired"


@pytest.mark.parametrize("model", MODELS)
def test_no_public_input_takes_a_handle(
    splitserve_server: TritonServer, handle_key: bytes, model: str
) -> None:
    """Even a genuine handle gets a client nothing: no input of ``llm`` accepts one."""
    with grpcclient.InferenceServerClient(splitserve_server.grpc_url) as client:
        inputs = prefill_inputs(np.array([[1, 450, 9]], np.int64), GREEDY_ONE)
        handle = client.infer("prefill", inputs, parameters=auth(handle_key)).as_numpy("kv_handle")
    as_tensor = {"kv_handle": (handle, "UINT8")}
    as_json = {"kv_handle": handle.reshape(-1).tolist()}
    with GrpcStream(splitserve_server.grpc_url) as stream:
        assert "kv_handle" in stream.error_of(model, generate_inputs("hi", tensors=as_tensor))
        assert "kv_handle" in stream.error_of(model, generate_inputs("hi", sampling=as_json))
