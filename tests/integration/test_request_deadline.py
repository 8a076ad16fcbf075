"""Requests that must end before they finish: a client cancel while ``llm`` retries a full
prefill pool ends the request at once, and a request past its deadline (``timeout`` or
``deadline_ms`` in ``sampling_parameters``, else the server's ``request_timeout_s``) ends with a
timeout error and FINAL, whether it waits for prefill or decodes, and frees its KV blocks."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from llm_client import (
    LEASE_TTL_S,
    MAX_MODEL_LEN,
    GrpcStream,
    gauges,
    generate_inputs,
    infer_inputs,
    samples,
    splitserve_triton,
    wait_for,
)
from tritonclient.utils import InferenceServerException

from splitserve.deploy.launcher import TritonInstall, TritonServer
from splitserve.deploy.render import render
from splitserve.deploy.spec import DeploymentSpec, RoleSpec
from splitserve.serving import bls_contract
from splitserve.transport.key import generate_key, key_environ

pytestmark = pytest.mark.triton

ENGINE = {"model": "tiny", "max_model_len": 256, "num_kv_blocks": 32}
"""Two prompts of 240 tokens (15 blocks of 16 each) fill prefill's pool."""
FILL_LEN = 240
FILL_TOKENS = itertools.count(65)
"""Each fill prompt is one token repeated, a different one each (over the module's tests too):
prompts that shared blocks would share them in the prefix cache and take one new block each."""
FILL_BLOCKS = 15
WAITING_PROMPT = "a" * 239
"""Needs 15 blocks of prefill's pool, which never has them once filled."""
DEFAULT_TIMEOUT_S = 3.0
"""The tiny server's ``request_timeout_s`` on ``llm``."""
PROMPT_END_S = 1.5
"""How soon a cancelled request must be gone; its retries would go on for a minute."""
TIMED_OUT = "timed out"


@pytest.fixture(scope="module")
def small_server(
    triton_install: TritonInstall, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[TritonServer, bytes]]:
    """``llm`` + ``prefill`` on the tiny model with small pools, leases that outlive the module
    and a server-wide request deadline; with its handle key, to fill prefill's pool directly."""
    key = generate_key()
    spec = DeploymentSpec(
        layout="disagg",
        settings=ENGINE,
        prefill=RoleSpec(settings={"lease_ttl_s": 600.0}),
        decode=RoleSpec(settings={"request_timeout_s": DEFAULT_TIMEOUT_S}),
    )
    server = splitserve_triton(
        render(spec, tmp_path_factory.mktemp("deadline_repo")),
        tmp_path_factory.mktemp("triton-deadline"),
        triton_install,
        env=key_environ(key),
    )
    server.start(60.0)
    try:
        yield server, key
    finally:
        server.stop()
    log = server.log_path
    assert log is not None
    assert "Traceback" not in log.read_text(errors="replace"), f"a model logged an exception: {log}"


def fill_prefill_pool(server: TritonServer, key: bytes) -> float:
    """Lease prefill's blocks until it answers that its pool is full; its blocks in use."""
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        for n in range(ENGINE["num_kv_blocks"]):
            rid = f"fill-{time.monotonic_ns()}-{n}"
            inputs = infer_inputs(
                {
                    "input_ids": (np.full((1, FILL_LEN), next(FILL_TOKENS), np.int64), "INT64"),
                    "sampling_parameters": (
                        np.array([[b'{"max_tokens": 1}']], np.object_),
                        "BYTES",
                    ),
                    "seed": (np.array([[1]], np.uint64), "UINT64"),
                    "request_id": (np.array([[rid.encode()]], np.object_), "BYTES"),
                }
            )
            parameters = {bls_contract.AUTH: bls_contract.auth_tag(key, rid)}
            try:
                client.infer("prefill", inputs, parameters=parameters)
            except InferenceServerException as exc:
                assert bls_contract.POOL_FULL in exc.message(), exc
                break

    def used() -> float:
        return gauges(server)[("splitserve_kv_blocks_used", "prefill")]

    # Published every metrics interval: wait until it shows a pool without room for a fill.
    assert wait_for(lambda: used() > ENGINE["num_kv_blocks"] - FILL_BLOCKS, 2.0), used()
    return used()


def errors(server: TritonServer, model: str, kind: str) -> float:
    return sum(
        value
        for name, labels, value in samples(server)
        if name == "splitserve_errors_total" and labels["model"] == model and labels["kind"] == kind
    )


def llm_idle(server: TritonServer) -> bool:
    values = gauges(server)
    return (
        values[("splitserve_queue_depth", "llm")] == 0
        and values[("splitserve_requests_active", "llm")] == 0
        and values[("splitserve_kv_blocks_used", "llm")] == 0
    )


def waiting_for_prefill(server: TritonServer, sampling: dict[str, Any]) -> GrpcStream:
    """A stream whose one request is retrying prefill (its pool full), checked on the metrics."""
    before = errors(server, "prefill", "unavailable")
    stream = GrpcStream(server.grpc_url)
    try:
        stream.send("llm", generate_inputs(WAITING_PROMPT, stream=True, sampling=sampling))
        retried = wait_for(lambda: errors(server, "prefill", "unavailable") >= before + 2, 10.0)
        assert retried, "llm never retried prefill"
        # Each model publishes its metrics on its own clock.
        queued = wait_for(lambda: gauges(server)[("splitserve_queue_depth", "llm")] == 1, 1.0)
        assert queued, gauges(server)
    except BaseException:
        stream.close(cancel=True)
        raise
    return stream


def test_cancel_while_retrying_prefill_ends_the_request_at_once(
    small_server: tuple[TritonServer, bytes],
) -> None:
    server, key = small_server
    leased = fill_prefill_pool(server, key)
    cancelled = errors(server, "llm", "cancelled")
    stream = waiting_for_prefill(server, {"max_tokens": 8})
    stream.close(cancel=True)
    started = time.monotonic()
    assert wait_for(lambda: errors(server, "llm", "cancelled") == cancelled + 1, PROMPT_END_S)
    assert time.monotonic() - started < PROMPT_END_S
    assert wait_for(lambda: llm_idle(server), 1.0), gauges(server)
    # Nothing more than the test's own leases is held in prefill's pool.
    assert gauges(server)[("splitserve_kv_blocks_used", "prefill")] == leased


@pytest.mark.parametrize(
    ("sampling", "deadline_s"),
    [({"timeout": 0.5}, 0.5), ({"deadline_ms": 700}, 0.7), ({}, DEFAULT_TIMEOUT_S)],
    ids=["timeout", "deadline_ms", "server-default"],
)
def test_deadline_ends_a_request_waiting_for_prefill(
    small_server: tuple[TritonServer, bytes], sampling: dict[str, Any], deadline_s: float
) -> None:
    server, key = small_server
    leased = fill_prefill_pool(server, key)
    sent = time.monotonic()
    with GrpcStream(server.grpc_url) as stream:
        stream.send("llm", generate_inputs(WAITING_PROMPT, stream=True, sampling=sampling))
        result, error = stream.next(timeout_s=deadline_s + 10.0)
    took = time.monotonic() - sent
    assert result is None and error is not None, result
    assert TIMED_OUT in error.message(), error
    assert deadline_s <= took < deadline_s + PROMPT_END_S, took
    assert wait_for(lambda: llm_idle(server), 1.0), gauges(server)
    assert gauges(server)[("splitserve_kv_blocks_used", "prefill")] == leased


def session_idle(server: TritonServer) -> bool:
    values = gauges(server)
    return all(
        values[("splitserve_kv_blocks_used", pool)] == 0
        for pool in ("llm", "prefill", "llm_colocated")
    ) and all(values[("splitserve_requests_active", m)] == 0 for m in ("llm", "llm_colocated"))


@pytest.mark.parametrize("model", ["llm", "llm_colocated"])
def test_deadline_ends_a_decoding_request_and_frees_its_blocks(
    splitserve_server: TritonServer, model: str
) -> None:
    assert wait_for(lambda: session_idle(splitserve_server), 10.0), gauges(splitserve_server)
    sampling = {
        "temperature": 0.0,
        "max_tokens": MAX_MODEL_LEN - 16,
        "ignore_eos": True,
        "timeout": 1.0,
    }
    with GrpcStream(splitserve_server.grpc_url) as stream:
        stream.send(
            model, generate_inputs("The old lighthouse keeper", stream=True, sampling=sampling)
        )
        tokens = 0
        while True:
            result, error = stream.next()
            if error is not None:
                break
            assert result is not None
            tokens += 1
    assert TIMED_OUT in error.message(), error
    assert 0 < tokens < MAX_MODEL_LEN - 16, "the request did not decode before its deadline"
    assert stream.events.empty(), "a response came after the timeout error"
    assert wait_for(lambda: session_idle(splitserve_server), 2.0), gauges(splitserve_server)


def test_deadline_during_the_prefill_call_releases_the_late_lease(
    splitserve_server: TritonServer,
) -> None:
    """The request stops waiting at its deadline; the lease of the prefill that completes
    afterwards is released at once, not left to expire."""
    assert wait_for(lambda: session_idle(splitserve_server), 10.0), gauges(splitserve_server)

    def leases(outcome: str) -> float:
        return gauges(splitserve_server)[(f"splitserve_leases_{outcome}_total", "prefill")]

    released, expired = leases("released"), leases("expired")
    # About 3900 tokens: their prompt pass takes several times the deadline here, their intake
    # (tokenizing) a fraction of it.
    prompt = "lighthouse " * 1300
    sampling = {"max_tokens": 1, "deadline_ms": 30}
    with GrpcStream(splitserve_server.grpc_url) as stream:
        stream.send("llm", generate_inputs(prompt, sampling=sampling))
        result, error = stream.next()
    assert result is None and error is not None and TIMED_OUT in error.message(), result
    assert wait_for(lambda: leases("released") == released + 1, LEASE_TTL_S / 2)
    assert leases("expired") == expired
    assert wait_for(lambda: session_idle(splitserve_server), 2.0), gauges(splitserve_server)
