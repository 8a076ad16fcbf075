"""Servers and client calls of the multi-node tests: a ``splitserve serve`` in a node's network
namespace, and ``multinode_client.py`` commands run inside a node (the only place its servers'
ports are reachable from)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import netns
import pytest
from llm_client import MAX_MODEL_LEN, SERVE_ENGINE

from splitserve.testing.checkpoints import write_random_checkpoint

CLIENT = Path(__file__).with_name("multinode_client.py")
SPLITSERVE = Path(sys.executable).with_name("splitserve")


def server_args(ckpt: Path, work: Path) -> list[str]:
    """What every server of a test deployment is started with: the checkpoint, its limits and
    a fresh key file (mode 0600) in ``work``."""
    key = work / "handle.key"
    key.write_text(os.urandom(32).hex() + "\n")
    key.chmod(0o600)
    return [
        "--model", str(ckpt),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--param", f"num_kv_blocks={SERVE_ENGINE['num_kv_blocks']}",
        "--key-file", str(key),
    ]  # fmt: skip


class Server:
    """One ``splitserve serve`` in a node's namespace; its log beside the test's files."""

    def __init__(self, node: netns.Node, log: Path, args: list[str]) -> None:
        self.node = node
        self.log = log
        env = {**os.environ, "UCX_TLS": "tcp", "PYTHONUNBUFFERED": "1"}
        with log.open("wb") as out:
            self.proc = node.popen(
                [str(SPLITSERVE), "serve", *args], env=env, stdout=out, stderr=subprocess.STDOUT
            )

    def wait_ready(self, deadline: float) -> None:
        while not client(self.node, "ready", "http://127.0.0.1:8000"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-4000:]
                pytest.fail(f"{self.node.name} did not start:\n{tail}")
            time.sleep(1.0)

    def kill_node(self) -> None:
        """kill -9 of every process of the node: the machine died."""
        pids = subprocess.run(
            ["ip", "netns", "pids", self.node.netns], capture_output=True, text=True
        ).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill_node()


def client(node: netns.Node, *args: Any, timeout_s: float = 180.0) -> Any:
    done = node.run([sys.executable, str(CLIENT), *map(str, args)], check=False, timeout=timeout_s)
    if done.returncode != 0:
        raise AssertionError(f"client {args[0]} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def gauges(node: netns.Node) -> dict[str, float]:
    return client(node, "gauges", "http://127.0.0.1:8002/metrics")


def wait_until(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def is_idle(node: netns.Node, model: str) -> bool:
    values = gauges(node)
    leases = values.get(f"splitserve_leases_outstanding|{model}", 0.0)
    return values[f"splitserve_kv_blocks_used|{model}"] == 0 and leases == 0


def slow_checkpoint(path: Path, num_layers: int) -> Path:
    """A checkpoint whose pass over a ~3k-token prompt on one core lasts seconds: long enough to
    act inside it."""
    return write_random_checkpoint(
        path,
        hidden_size=512,
        num_layers=num_layers,
        num_heads=8,
        num_kv_heads=2,
        intermediate_size=1536,
        max_position_embeddings=4096,
        weight_scale=0.5,
    )


@contextlib.contextmanager
def prefill_and_decode(
    ckpt: Path,
    work: Path,
    prefill_args: list[str],
    decode_args: list[str],
    start_timeout_s: float = 240.0,
    prefills: int = 1,
) -> Iterator[tuple[netns.Cluster, dict[str, Server]]]:
    """``prefills`` ``--role prefill`` servers (``prefill0``, ...; each on core 0) and a
    ``--role decode`` server calling them, in namespaces of their own, with extra flags each;
    skips where namespaces cannot be made."""
    if (reason := netns.available()) is not None:
        pytest.skip(reason)
    common = server_args(ckpt, work)
    names = [f"prefill{i}" for i in range(prefills)]
    with netns.Cluster((*names, "decode")) as cluster:
        decode = cluster["decode"]
        servers = {
            name: Server(cluster[name], work / f"{name}.log",
                         [*common, "--role", "prefill", "--advertise-host", cluster[name].address,
                          "--prefill-cores", "0", *prefill_args])
            for name in names
        }  # fmt: skip
        urls = [f"--prefill-url={cluster[name].address}:8001" for name in names]
        servers["decode"] = Server(
            decode,
            work / "decode.log",
            [*common, "--role", "decode", "--advertise-host", decode.address, *urls, *decode_args],
        )
        try:
            deadline = time.monotonic() + start_timeout_s
            for server in servers.values():
                server.wait_ready(deadline)
            yield cluster, servers
        finally:
            for server in servers.values():
                server.stop()
