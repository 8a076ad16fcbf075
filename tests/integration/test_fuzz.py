"""Property-based requests over HTTP and gRPC: random input names, dtypes, shapes, values, JSON
and bytes. Whatever arrives, the answer is a Triton error or a valid response within a timeout,
and no stub crashes. Example counts are small for CI; raise ``FUZZ_EXAMPLES`` for a long run."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llm_client import GrpcStream, infer_inputs, is_final, is_ready, post

from splitserve.deploy.launcher import TritonServer
from splitserve.testing.procfs import stub_instances

pytestmark = pytest.mark.triton

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "25"))
TIMEOUT_S = 60.0
MODELS = ("llm", "llm_colocated")
NAMES = (
    "text_input",
    "stream",
    "sampling_parameters",
    "max_tokens",
    "temperature",
    "top_k",
    "seed",
    "stop",
    "beam_width",
    "exclude_input_in_output",
    "kv_handle",
    "input_ids",
)
DTYPES = {
    "BOOL": np.bool_,
    "INT8": np.int8,
    "INT32": np.int32,
    "INT64": np.int64,
    "UINT64": np.uint64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BYTES": np.object_,
}
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)
sampling_json = st.dictionaries(
    st.sampled_from(["max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "n", "x"]),
    json_values,
    max_size=4,
)
http_bodies = st.dictionaries(
    st.sampled_from(NAMES) | st.text(max_size=8),
    json_values | sampling_json.map(json.dumps),
    max_size=5,
).map(
    lambda d: {
        k: min(v, 64) if k == "max_tokens" and isinstance(v, int) else v for k, v in d.items()
    }
)


@st.composite
def tensors(draw: st.DrawFn) -> tuple[np.ndarray, str]:
    datatype = draw(st.sampled_from(sorted(DTYPES)))
    shape = draw(st.lists(st.integers(0, 3), min_size=0, max_size=3))
    size = int(np.prod(shape)) if shape else 1
    if datatype == "BYTES":
        values: list[Any] = draw(st.lists(st.binary(max_size=24), min_size=size, max_size=size))
        return np.array(values, dtype=np.object_).reshape(shape), datatype
    ints = st.integers(-3, 64) | st.sampled_from([2**31 - 1, -(2**31)])
    numbers = st.floats(-4, 4, width=16) if datatype.startswith("FP") else ints
    values = draw(
        st.lists(st.booleans() if datatype == "BOOL" else numbers, min_size=size, max_size=size)
    )
    array = np.array(values).astype(DTYPES[datatype]) if values else np.zeros(0, DTYPES[datatype])
    return array.reshape(shape), datatype


grpc_requests = st.dictionaries(st.sampled_from(NAMES), tensors(), min_size=1, max_size=4)


@pytest.fixture
def stubs(splitserve_server: TritonServer) -> dict[str, int]:
    assert splitserve_server.pid is not None
    before = stub_instances(splitserve_server.pid)
    yield before
    assert stub_instances(splitserve_server.pid) == before, "a stub died or was restarted"
    assert is_ready(splitserve_server)


@FUZZ
@given(model=st.sampled_from(MODELS), body=http_bodies | st.binary(max_size=64))
def test_http_generate(
    splitserve_server: TritonServer, stubs: dict[str, int], model: str, body: Any
) -> None:
    status, text = post(splitserve_server, model, "generate", body)
    answer = json.loads(text)
    if status == 200 and "error" not in answer:
        assert isinstance(answer["text_output"], str)
    else:
        assert status in (200, 400, 500) and answer["error"], (status, text)


@FUZZ
@given(model=st.sampled_from(MODELS), request=grpc_requests)
def test_grpc_stream(
    splitserve_server: TritonServer,
    stubs: dict[str, int],
    model: str,
    request: dict[str, tuple[np.ndarray, str]],
) -> None:
    with GrpcStream(splitserve_server.grpc_url) as stream:
        stream.send(model, infer_inputs(request))
        while True:
            result, error = stream.next(TIMEOUT_S)
            if error is not None:
                assert error.message()
                return
            assert result is not None
            if is_final(result):
                return
