"""How the launcher spawns tritonserver (``launcher.spawn``): beside a busy gRPC client without
running gRPC's fork handlers (forked children aborted, issue 28), as the same pid, and with
SIGTERM when the thread that spawned it exits."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from splitserve.deploy.launcher import free_ports, spawn

SPAWNS = 100
SLEEP = shutil.which("sleep") or "/bin/sleep"
SIGTERM_WITHIN_S = 5.0


@pytest.fixture
def busy_grpc_client() -> Iterator[None]:
    """A gRPC client in this process asking a closed port for readiness without a pause, on a
    thread of its own (like the OpenAI frontend's checks while Triton is away)."""
    (port,) = free_ports(1)
    stop = threading.Event()
    calls = threading.Semaphore(0)

    async def ask() -> None:
        client = grpcaio.InferenceServerClient(f"127.0.0.1:{port}")
        while not stop.is_set():
            with contextlib.suppress(InferenceServerException):  # refused, as meant
                await client.is_server_ready()
            calls.release()
        await client.close()

    thread = threading.Thread(target=asyncio.run, args=(ask(),), daemon=True)
    thread.start()
    assert calls.acquire(timeout=10.0), "the gRPC client never ran"
    yield
    stop.set()
    thread.join(10.0)


def test_spawn_runs_no_fork_handlers(
    busy_grpc_client: None, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """With ``preexec_fn`` (a fork), every spawn here logged gRPC's "skipping fork() handlers"
    and about one in 100 children died of SIGABRT before exec."""
    with (tmp_path / "out").open("wb") as out:
        codes = [spawn([SLEEP, "0"], dict(os.environ), out).wait() for _ in range(SPAWNS)]
    assert codes == [0] * SPAWNS
    err = capfd.readouterr().err
    assert "fork" not in err, err


def test_spawn_becomes_the_command(tmp_path: Path) -> None:
    """The exec wrapper leaves no process behind: the pid is the command's, in its own session."""
    out_path = tmp_path / "out"
    with out_path.open("wb") as out:
        proc = spawn(["/bin/sh", "-c", 'echo "$$ $(ps -o sid= -p $$)" "$0"', "a b"], {}, out)
        assert proc.wait() == 0
    pid, sid, arg = out_path.read_text().split(maxsplit=2)
    assert int(pid) == proc.pid == int(sid)
    assert arg.strip() == "a b"


def test_spawned_process_ends_with_its_thread(tmp_path: Path) -> None:
    spawned: list[subprocess.Popen[bytes]] = []
    with (tmp_path / "out").open("wb") as out:
        thread = threading.Thread(target=lambda: spawned.append(spawn([SLEEP, "60"], {}, out)))
        thread.start()
        thread.join()
        (proc,) = spawned
        deadline = time.monotonic() + SIGTERM_WITHIN_S
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
        assert proc.wait() == -signal.SIGTERM
