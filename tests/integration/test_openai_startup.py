"""``splitserve serve --openai-port`` as a user runs it (issue 28): it comes up on every start
(tritonserver is spawned before the frontend's gRPC client exists, and without fork handlers),
its ``/health`` stays 200 under a burst of streams that saturates the machine and while Triton
stalls for seconds, and turns 503 soon after Triton is gone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

import pytest
from llm_client import answers_200, stop_process
from test_openai_api import NAME, PROMPT, base_url, http, start_frontend

from splitserve.deploy.launcher import TritonServer, free_ports
from splitserve.deploy.spec import DeploymentSpec

pytestmark = [pytest.mark.triton, pytest.mark.slow]

CYCLES_S = 60.0
"""Start/stop cycles run for about this long, at least ``MIN_CYCLES``."""
MIN_CYCLES = 3
UP_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 60.0
BURST = 64
BURST_TOKENS = 400
POLL_EVERY_S = 0.05
STALL_S = 4.0
"""Less than a readiness check's timeout (5 s): not a failure, however long it took."""
PROBE_TIMEOUT_S = 1.0
"""A Kubernetes probe's default timeout."""
GONE_503_WITHIN_S = 10.0
"""The frontend's checks: 3 failures in a row, one a second, each fails at once when refused."""
FORK_HANDLER_SIGNS = ("fork()", "fork_posix", "epoll_wait error")


@dataclass(frozen=True)
class Serve:
    proc: subprocess.Popen[bytes]
    openai_port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.openai_port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def serve(log: Path, layout: str) -> Iterator[Serve]:
    """``splitserve serve --model tiny --openai-port`` in a process of its own, on free ports;
    up (its ``/v1/models`` answers) when yielded, SIGTERM-ed and gone after."""
    http_port, grpc_port, metrics_port, openai_port = free_ports(4)
    ports = {"http": http_port, "grpc": grpc_port, "metrics": metrics_port, "openai": openai_port}
    flags = [f"--{name}-port={port}" for name, port in ports.items()]
    flags += ["--model=tiny", f"--layout={layout}", "--host=127.0.0.1"]
    cmd = [sys.executable, "-m", "splitserve_tools.cli", "serve", *flags]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    running = Serve(proc, openai_port, log)
    try:
        deadline = time.monotonic() + UP_TIMEOUT_S
        while not answers_200(f"{running.url}/v1/models"):
            assert proc.poll() is None, f"serve exited with {proc.returncode}:\n{running.output()}"
            assert time.monotonic() < deadline, f"not up in {UP_TIMEOUT_S} s:\n{running.output()}"
            time.sleep(0.1)
        yield running
    finally:
        stop_process(proc, STOP_TIMEOUT_S)


def complete(url: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
    status, answer = http(f"{url}/v1/completions", json.dumps(body).encode())
    assert status == 200, answer
    return json.loads(answer)


@pytest.mark.usefixtures("triton_install")
def test_serve_with_openai_port_starts_every_time(tmp_path: Path) -> None:
    started = time.monotonic()
    cycles = 0
    while cycles < MIN_CYCLES or time.monotonic() - started < CYCLES_S:
        log = tmp_path / f"serve{cycles}.log"
        with serve(log, "colocated") as running:
            # The frontend starts once Triton is ready, with its first readiness check done.
            assert http(f"{running.url}/health")[0] == 200, running.output()
            assert json.loads(http(f"{running.url}/v1/models")[1])["data"][0]["id"] == "tiny"
            assert complete(running.url, 4)["usage"]["completion_tokens"] == 4
        assert running.proc.returncode == 0, running.output()
        output = running.output()
        assert not [sign for sign in FORK_HANDLER_SIGNS if sign in output], output
        cycles += 1
    print(f"{cycles} start/stop cycles in {time.monotonic() - started:.0f} s")


def stream(url: str, max_tokens: int) -> tuple[int, int, list[bytes]]:
    """One streamed completion, read as it comes: HTTP status, completion tokens (the usage
    chunk's), error events."""
    host, port = url.removeprefix("http://").split(":")
    conn = HTTPConnection(host, int(port), timeout=120)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True}
    body |= {"ignore_eos": True, "stream_options": {"include_usage": True}}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    tokens, errors = 0, []
    for line in response:
        if line.startswith(b"data: [DONE]"):
            break
        if line.startswith(b"data: "):
            chunk = json.loads(line.removeprefix(b"data: "))
            if "error" in chunk:
                errors.append(line)
            elif chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    conn.close()
    return response.status, tokens, errors


def poll_while(
    url: str, busy: Callable[[], bool], timeout_s: float = 10.0
) -> list[tuple[int | str, float]]:
    """GET ``url`` every ``POLL_EVERY_S`` while ``busy()``: (status or error, seconds) each."""
    polls: list[tuple[int | str, float]] = []
    while busy():
        sent = time.monotonic()
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                status: int | str = response.status
        except urllib.error.HTTPError as exc:
            status = exc.code
        except OSError as exc:
            status = repr(exc)
        polls.append((status, time.monotonic() - sent))
        time.sleep(POLL_EVERY_S)
    return polls


@pytest.mark.usefixtures("triton_install")
def test_health_stays_200_under_a_burst(tmp_path: Path) -> None:
    with serve(tmp_path / "serve.log", "both") as running:
        results: list[tuple[int, int, list[bytes]]] = []
        streams = [
            threading.Thread(target=lambda: results.append(stream(running.url, BURST_TOKENS)))
            for _ in range(BURST)
        ]
        for thread in streams:
            thread.start()
        polls = poll_while(f"{running.url}/health", lambda: any(t.is_alive() for t in streams))
        for thread in streams:
            thread.join()
    assert len(results) == BURST
    assert all(status == 200 and not errors for status, _, errors in results), results[:3]
    # Every stream ran to its end: the burst was real, for as long as the polls went on.
    assert [tokens for _, tokens, _ in results] == [BURST_TOKENS] * BURST
    bad = [poll for poll in polls if poll[0] != 200]
    slowest = max(seconds for _, seconds in polls)
    print(f"{len(polls)} polls of /health under {BURST} streams, slowest {slowest:.3f} s")
    assert len(polls) >= 20
    assert not bad, bad


@pytest.fixture
def tiny_server(start_splitserve: Callable[[DeploymentSpec], TritonServer]) -> TritonServer:
    return start_splitserve(DeploymentSpec(layout="colocated"))


def test_health_rides_out_a_stalled_triton_and_turns_503_once_it_is_gone(
    tiny_server: TritonServer,
) -> None:
    running = start_frontend(tiny_server.grpc_url, "llm_colocated", None)
    try:
        health = base_url(running).removesuffix("/v1") + "/health"
        assert http(health)[0] == 200
        # Triton answering nothing for a while (SIGSTOP) is as busy as it gets: /health must
        # neither wait on it nor turn 503, within a probe's usual 1 s timeout.
        assert tiny_server.pid is not None
        os.kill(tiny_server.pid, signal.SIGSTOP)
        try:
            stalled_until = time.monotonic() + STALL_S
            polls = poll_while(health, lambda: time.monotonic() < stalled_until, PROBE_TIMEOUT_S)
        finally:
            os.kill(tiny_server.pid, signal.SIGCONT)
        assert [status for status, _ in polls] == [200] * len(polls), polls
        stopping = time.monotonic()
        tiny_server.stop()
        gone = time.monotonic()
        while http(health)[0] == 200:
            assert time.monotonic() - gone < GONE_503_WITHIN_S, "still 200 without Triton"
            time.sleep(0.1)
        now = time.monotonic()
        print(f"/health: 503 {now - stopping:.1f} s after the stop began, {now - gone:.1f} s after")
        # Requests still say why at once.
        status, body = http(
            f"{base_url(running)}/completions",
            json.dumps({"model": NAME, "prompt": PROMPT, "max_tokens": 4}).encode(),
        )
        assert status == 503, body
    finally:
        running.stop()
