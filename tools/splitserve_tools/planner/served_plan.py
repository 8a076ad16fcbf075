"""A ``splitserve serve --plan`` subprocess for as long as a ``with`` block runs."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Ports:
    http: int = 18700
    grpc: int = 18701
    metrics: int = 18702


def _wait_ready(proc: subprocess.Popen[bytes], url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"splitserve serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(1.0)
    raise TimeoutError(f"the server was not ready after {timeout_s:.0f} s")


@contextmanager
def served(
    plan: Path, log: Path, ports: Ports | None = None, timeout_s: float = 600.0
) -> Iterator[str]:
    """Serve ``plan`` on loopback (output to ``log``); yields the gRPC address once ready."""
    ports = ports or Ports()
    cmd = [
        sys.executable, "-m", "splitserve_tools.cli", "serve", "--plan", str(plan),
        "--host", "127.0.0.1", "--http-port", str(ports.http),
        "--grpc-port", str(ports.grpc), "--metrics-port", str(ports.metrics),
    ]  # fmt: skip
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait_ready(proc, f"http://127.0.0.1:{ports.http}/v2/health/ready", timeout_s)
            yield f"127.0.0.1:{ports.grpc}"
        finally:
            proc.send_signal(2)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
