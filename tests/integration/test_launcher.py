"""The launcher against a real tritonserver, proven with the toy decoupled repository."""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from llm_client import GrpcStream, is_final

from splitserve.deploy.launcher import TritonInstall, TritonServer, free_ports
from splitserve.deploy.process_group import live_group_members, stub_shm_regions

pytestmark = pytest.mark.triton

MODEL = "echo_stream"
ServerFactory = Callable[[Path], TritonServer]


class ToyStream(GrpcStream):
    """A stream to the toy ``echo_stream`` model, with a request id per request."""

    def send_text(self, request_id: str, text: str, max_tokens: int | None = None) -> None:
        text_input = grpcclient.InferInput("text_input", [1], "BYTES")
        text_input.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
        inputs = [text_input]
        if max_tokens is not None:
            max_tokens_input = grpcclient.InferInput("max_tokens", [1], "INT32")
            max_tokens_input.set_data_from_numpy(np.array([max_tokens], dtype=np.int32))
            inputs.append(max_tokens_input)
        self.send(MODEL, inputs, request_id=request_id, enable_empty_final_response=True)

    def next_result(self, timeout_s: float = 10.0) -> grpcclient.InferResult:
        result, error = self.next(timeout_s)
        assert error is None, error
        assert result is not None
        return result


def text_of(result: grpcclient.InferResult) -> str:
    return result.as_numpy("text_output")[0].decode()


def post(server: TritonServer, endpoint: str, body: dict[str, object]) -> tuple[int, str]:
    request = urllib.request.Request(
        f"{server.http_url}/v2/models/{MODEL}/{endpoint}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def active_streams(server: TritonServer) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=5) as response:
        metrics = response.read().decode()
    match = re.search(r'^splitserve_toy_active\{model="echo_stream"\} (\S+)$', metrics, re.M)
    assert match, "splitserve_toy_active gauge missing from /metrics"
    return float(match.group(1))


def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_grpc_stream_sends_every_token_and_final_on_the_last(toy_server: TritonServer) -> None:
    prompt = "alpha beta gamma"
    with ToyStream(toy_server.grpc_url) as stream:
        stream.send_text("r1", prompt, max_tokens=5)
        results = [stream.next_result() for _ in range(5)]
    assert [text_of(r) for r in results] == ["alpha", "beta", "gamma", "alpha", "beta"]
    assert [is_final(r) for r in results] == [False] * 4 + [True]
    assert {r.get_response().id for r in results} == {"r1"}
    assert results[0].as_numpy("prefill_sum")[0] == sum(prompt.encode())
    assert results[1].as_numpy("prefill_sum") is None


def test_concurrent_requests_share_a_prefill_batch(toy_server: TritonServer) -> None:
    prompts = {f"c{i}": "w " * (i + 1) for i in range(8)}
    with ToyStream(toy_server.grpc_url) as stream:
        for request_id, prompt in prompts.items():
            stream.send_text(request_id, prompt, max_tokens=1)
        results = [stream.next_result() for _ in prompts]
    for result in results:
        prompt = prompts[result.get_response().id]
        assert result.as_numpy("prefill_sum")[0] == sum(prompt.encode())
        assert is_final(result)
    batch_sizes = [int(r.as_numpy("prefill_batch_size")[0]) for r in results]
    assert max(batch_sizes) > 1, batch_sizes


def test_invalid_input_reaches_grpc_client_as_error(toy_server: TritonServer) -> None:
    with ToyStream(toy_server.grpc_url) as stream:
        stream.send_text("bad", "   ", max_tokens=3)
        result, error = stream.next()
        assert result is None
        assert error is not None
        assert "at least one word" in error.message()
        stream.send_text("good", "ok", max_tokens=1)
        assert text_of(stream.next_result()) == "ok"


def test_cancel_is_seen_by_the_model(toy_server: TritonServer) -> None:
    stream = ToyStream(toy_server.grpc_url)
    try:
        stream.send_text("long", "tick tock", max_tokens=1_000_000)
        for _ in range(3):
            stream.next_result()
        assert active_streams(toy_server) == 1
    finally:
        stream.close(cancel=True)
    assert wait_for(lambda: active_streams(toy_server) == 0), "cancelled stream still running"


def test_http_generate_stream_sends_server_sent_events(toy_server: TritonServer) -> None:
    status, body = post(toy_server, "generate_stream", {"text_input": "x y", "max_tokens": 3})
    assert status == 200
    events = [json.loads(line[len("data: ") :]) for line in body.splitlines() if line]
    assert [event["text_output"] for event in events] == ["x", "y", "x"]
    assert events[0]["prefill_batch_size"] >= 1


def test_http_generate_needs_exactly_one_response(toy_server: TritonServer) -> None:
    status, body = post(toy_server, "generate", {"text_input": "solo", "max_tokens": 1})
    assert status == 200
    assert json.loads(body)["text_output"] == "solo"
    status, body = post(toy_server, "generate", {"text_input": "a b", "max_tokens": 2})
    assert "exactly 1 response" in json.loads(body)["error"]


def test_invalid_arg_is_http_400(toy_server: TritonServer) -> None:
    status, body = post(toy_server, "generate", {"text_input": "x", "max_tokens": 0})
    assert status == 400
    assert "max_tokens must be >= 1" in json.loads(body)["error"]


def test_instance_identity_and_torch_import_are_logged(toy_server: TritonServer) -> None:
    log = toy_server.log_tail(max_bytes=1 << 20)
    assert "echo_stream instance name=echo_stream_0_0 kind=CPU device_id=0" in log
    assert re.search(r"echo_stream torch \S+ in \d+\.\d+ s", log)


def test_graceful_stop_leaves_no_process_behind(
    triton_install: TritonInstall,
    toy_repo: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(toy_repo / "toy_prefill", repo / "toy_prefill")
    http_port, grpc_port, metrics_port = free_ports(3)
    shm_bytes = 4 << 20
    server = TritonServer(
        repo,
        http_port=http_port,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        backend_config={"python": {"shm-default-byte-size": shm_bytes}},
        workdir=tmp_path / "work",
        install=triton_install,
    )
    with caplog.at_level(logging.INFO, logger="splitserve.deploy.launcher"), server:
        pid = server.pid
        assert pid is not None
        members = live_group_members(pid)
        assert len(members) == 2, "expected the server and one stub"
        (stub_pid,) = [member for member in members if member != pid]
        stub_argv = Path(f"/proc/{stub_pid}/cmdline").read_bytes().split(b"\0")
        assert str(shm_bytes).encode() in stub_argv
    assert not server.is_alive()
    assert live_group_members(pid) == []
    assert "killing leftover" not in caplog.text
    assert "exited with code 0" in caplog.text


def test_stop_kills_a_server_stuck_on_a_stream(
    make_triton_server: ServerFactory, toy_repo: Path, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(toy_repo, repo)
    config = repo / MODEL / "config.pbtxt"
    lines = config.read_text().splitlines(keepends=True)
    config.write_text("".join(line for line in lines if "import_torch" not in line))
    server = make_triton_server(repo).start(timeout_s=60)
    pid = server.pid
    assert pid is not None
    regions = stub_shm_regions(live_group_members(pid))
    assert len(regions) == 2
    stream = ToyStream(server.grpc_url)
    try:
        stream.send_text("endless", "spin", max_tokens=1_000_000)
        stream.next_result()
        started = time.monotonic()
        server.stop(timeout_s=0.5)
        assert time.monotonic() - started < 5
    finally:
        stream.close(cancel=True)
    assert live_group_members(pid) == []
    assert not any(region.exists() for region in regions)


def test_failed_start_raises_with_the_log(
    make_triton_server: ServerFactory, tmp_path: Path
) -> None:
    broken = tmp_path / "repo" / "broken"
    (broken / "1").mkdir(parents=True)
    (broken / "config.pbtxt").write_text('backend: "python"\nthis is not a model config\n')
    server = make_triton_server(tmp_path / "repo")
    with pytest.raises(RuntimeError, match=r"(?s)exited with code.*broken"):
        server.start(timeout_s=60)
    assert not server.is_alive()
