"""A prefill server with ``--kv-transfer-dtype fp8`` feeding a decode server in another network
namespace: the KV crosses as e4m3 (the decode server needs no flag: it follows the handle), every
request streams its tokens, and nothing is left on either node. What fp8 does to the output is
measured, not asserted here (``scripts/kv_fp8_quality.py``, BENCHMARKS.md)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import netns
import pytest
from multinode_servers import Server, client, gauges, is_idle, server_args, wait_until

pytestmark = pytest.mark.triton
pytest.importorskip("nixl._api", reason="NIXL is not installed (pip install nixl-cu12)")

START_TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def nodes(serve_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[netns.Cluster]:
    if (reason := netns.available()) is not None:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("multinode_fp8")
    common = server_args(serve_ckpt, tmp)
    with netns.Cluster(("prefill0", "decode")) as cluster:
        prefill, decode = cluster["prefill0"], cluster["decode"]
        servers = [
            Server(prefill, tmp / "prefill.log",
                   [*common, "--role", "prefill", "--advertise-host", prefill.address,
                    "--kv-transfer-dtype", "fp8"]),
            Server(decode, tmp / "decode.log",
                   [*common, "--role", "decode", "--advertise-host", decode.address,
                    f"--prefill-url={prefill.address}:8001"]),
        ]  # fmt: skip
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            for server in servers:
                server.wait_ready(deadline)
            yield cluster
        finally:
            for server in servers:
                server.stop()


def test_kv_crosses_as_fp8_and_every_request_completes(nodes: netns.Cluster) -> None:
    decode = nodes["decode"]
    for i in range(4):
        got = client(decode, "generate", "127.0.0.1:8001", f"fp8 across nodes {i} " * 8, 12, "1")
        assert "text" in got and got["tokens"] == 12, got
    values = gauges(decode)
    moved = values["splitserve_kv_handoff_bytes_total|llm"]
    assert moved > 0 and values["splitserve_kv_handoff_fp8_bytes_total|llm"] == moved
    assert values["splitserve_kv_handoff_failures|llm"] == 0
    # The prefill server streams by default, but prompts this short (under
    # kv_stream_min_tokens) it answers whole, after the pass, on the same stream.
    assert values["splitserve_kv_streamed_requests_total|llm"] == 0
    wait_until(lambda: is_idle(decode, "llm"), 30, "decode idle")
    wait_until(lambda: is_idle(nodes["prefill0"], "prefill"), 30, "prefill idle")
