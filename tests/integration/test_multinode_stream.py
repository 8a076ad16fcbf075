"""Layer-wise KV streaming between a prefill and a decode server in two network namespaces, on a
checkpoint whose prompt pass (prefill on one core) lasts seconds, long enough to act inside
it: decode pulls layers while the pass runs and the greedy text equals transformers'; a prefill
killed halfway through its layers ends the request with a clear error, and the decode server
is left with nothing held."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import netns
import pytest
from hf_reference import hf_greedy
from multinode_servers import CLIENT, Server, client, gauges, is_idle, server_args, wait_until

from splitserve.testing.checkpoints import write_random_checkpoint
from splitserve.tokenizer import load_tokenizer

pytestmark = pytest.mark.triton
pytest.importorskip("nixl._api", reason="NIXL is not installed (pip install nixl-cu12)")

START_TIMEOUT_S = 240.0
WORDS = 1000
"""About 3k tokens: a pass of seconds on one core."""
MAX_TOKENS = 8
LAYERS = 8


@pytest.fixture(scope="module")
def slow_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(
        tmp_path_factory.mktemp("stream_ckpt"),
        hidden_size=512,
        num_layers=LAYERS,
        num_heads=8,
        num_kv_heads=2,
        intermediate_size=1536,
        max_position_embeddings=4096,
        weight_scale=0.5,
    )


@pytest.fixture(scope="module")
def nodes(
    slow_ckpt: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[netns.Cluster, dict[str, Server]]]:
    if (reason := netns.available()) is not None:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("multinode_stream")
    common = server_args(slow_ckpt, tmp)
    with netns.Cluster(("prefill0", "decode")) as cluster:
        prefill, decode = cluster["prefill0"], cluster["decode"]
        servers = {
            "prefill0": Server(prefill, tmp / "prefill.log",
                               [*common, "--role", "prefill", "--advertise-host", prefill.address,
                                "--prefill-cores", "0"]),
            "decode": Server(decode, tmp / "decode.log",
                             [*common, "--role", "decode", "--advertise-host", decode.address,
                              f"--prefill-url={prefill.address}:8001",
                              "--param", "metrics_interval_s=0.05"]),
        }  # fmt: skip
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            for server in servers.values():
                server.wait_ready(deadline)
            yield cluster, servers
        finally:
            for server in servers.values():
                server.stop()


def prompt(i: int) -> str:
    return f"stream {i}" + " lorem" * WORDS


def test_layers_are_pulled_during_the_pass_and_the_text_equals_transformers(
    nodes: tuple[netns.Cluster, dict[str, Server]], slow_ckpt: Path
) -> None:
    decode = nodes[0]["decode"]
    got = client(decode, "generate", "127.0.0.1:8001", prompt(0), MAX_TOKENS, "1")
    tokenizer = load_tokenizer(slow_ckpt)
    want = hf_greedy(slow_ckpt, tokenizer.encode(prompt(0)), MAX_TOKENS, eos_token_ids=())
    assert got.get("text") == tokenizer.decode(want), got
    values = gauges(decode)
    assert values["splitserve_kv_streamed_requests_total|llm"] == 1
    assert values["splitserve_kv_streamed_layers_total|llm"] == LAYERS
    # The pull caught up with the pass and waited for its next layer: it ran during the pass.
    assert values["splitserve_kv_stream_wait_seconds_total|llm"] > 0
    wait_until(lambda: is_idle(decode, "llm"), 30, "decode idle")


def test_prefill_killed_mid_stream_ends_the_request_with_an_error(
    nodes: tuple[netns.Cluster, dict[str, Server]],
) -> None:
    cluster, servers = nodes
    decode = cluster["decode"]
    before = gauges(decode)["splitserve_kv_streamed_layers_total|llm"]
    args = ["midstream", "127.0.0.1:8001", "http://127.0.0.1:8002/metrics", prompt(1)]
    request = decode.popen(
        [sys.executable, str(CLIENT), *args, str(MAX_TOKENS)], stdout=subprocess.PIPE, text=True
    )
    assert request.stdout is not None
    assert request.stdout.readline().strip() == "pulling"
    servers["prefill0"].kill_node()
    out, _ = request.communicate(timeout=90)
    result = json.loads(out)
    assert "error" in result and "mid-stream" in result["error"], result
    values = gauges(decode)
    assert values["splitserve_kv_streamed_layers_total|llm"] - before < LAYERS
    assert values["splitserve_kv_streamed_requests_total|llm"] == 1
    wait_until(lambda: is_idle(decode, "llm"), 30, "decode holds nothing")
