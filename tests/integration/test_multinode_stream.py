"""Layer-wise KV streaming between a prefill and a decode server in two network namespaces, on a
checkpoint whose prompt pass (prefill on one core) lasts seconds, long enough to act inside
it: decode pulls layers while the pass runs and the greedy text equals transformers'; a prefill
killed halfway through its layers ends the request with a clear error, and the decode server
is left with nothing held."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import netns
import pytest
from hf_reference import hf_greedy
from multinode_servers import (
    CLIENT,
    Server,
    client,
    gauges,
    is_idle,
    prefill_and_decode,
    slow_checkpoint,
    wait_until,
)

from splitserve.tokenizer import load_tokenizer

pytestmark = pytest.mark.triton
pytest.importorskip("nixl._api", reason="NIXL is not installed (pip install nixl-cu12)")

WORDS = 1000
"""About 3k tokens: a pass of seconds on one core."""
MAX_TOKENS = 8
LAYERS = 8


@pytest.fixture(scope="module")
def slow_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return slow_checkpoint(tmp_path_factory.mktemp("stream_ckpt"), LAYERS)


@pytest.fixture(scope="module")
def nodes(
    slow_ckpt: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[netns.Cluster, dict[str, Server]]]:
    tmp = tmp_path_factory.mktemp("multinode_stream")
    fast_metrics = ["--param", "metrics_interval_s=0.05"]
    with prefill_and_decode(slow_ckpt, tmp, [], fast_metrics) as nodes:
        yield nodes


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
    assert request.stdout.readline().strip() == "pulling 0"
    servers["prefill0"].kill_node()
    out, _ = request.communicate(timeout=90)
    result = json.loads(out)
    assert "error" in result and "mid-stream" in result["error"], result
    values = gauges(decode)
    assert values["splitserve_kv_streamed_layers_total|llm"] - before < LAYERS
    assert values["splitserve_kv_streamed_requests_total|llm"] == 1
    wait_until(lambda: is_idle(decode, "llm"), 30, "decode holds nothing")
