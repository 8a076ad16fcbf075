"""KV pushes (``--kv-push``) between a prefill and a decode server in two network namespaces, on a
checkpoint whose prompt pass (prefill on one core) lasts seconds: prefill WRITEs each layer into
blocks decode reserved and the greedy text equals transformers', for a prompt of seconds and a
short one; a prefill killed halfway through its layers ends the request with a clear error,
and decode gets every block back once no WRITE can land any more."""

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
TARGET_TTL_S = 20
"""Decode's ``lease_ttl_s``: how long a push target stays valid (prefill posts no WRITE
after it), so how long a dead prefill's blocks stay quarantined at most (plus the transfer
timeout)."""
PUSHED = "splitserve_kv_pushed_layers_total|prefill"


@pytest.fixture(scope="module")
def slow_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return slow_checkpoint(tmp_path_factory.mktemp("push_ckpt"), LAYERS)


@pytest.fixture(scope="module")
def nodes(
    slow_ckpt: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[netns.Cluster, dict[str, Server]]]:
    tmp = tmp_path_factory.mktemp("multinode_push")
    fast_metrics = ["--param", "metrics_interval_s=0.05"]
    decode = ["--kv-push", *fast_metrics, "--param", f"lease_ttl_s={TARGET_TTL_S}",
              "--param", "kv_transfer_timeout_s=3"]  # fmt: skip
    with prefill_and_decode(slow_ckpt, tmp, fast_metrics, decode) as nodes:
        yield nodes


def prompt(i: int, words: int = WORDS) -> str:
    return f"push {i}" + " lorem" * words


@pytest.mark.parametrize("words", [WORDS, 20])
def test_pushed_kv_gives_the_text_of_transformers(
    nodes: tuple[netns.Cluster, dict[str, Server]], slow_ckpt: Path, words: int
) -> None:
    cluster, _ = nodes
    decode = cluster["decode"]
    before = gauges(decode).get("splitserve_kv_pushed_requests_total|llm", 0.0)
    got = client(decode, "generate", "127.0.0.1:8001", prompt(0, words), MAX_TOKENS, "1")
    tokenizer = load_tokenizer(slow_ckpt)
    want = hf_greedy(slow_ckpt, tokenizer.encode(prompt(0, words)), MAX_TOKENS, eos_token_ids=())
    assert got.get("text") == tokenizer.decode(want), got
    values = gauges(decode)
    assert values["splitserve_kv_pushed_requests_total|llm"] == before + 1
    # Nothing was pulled: no handle, no lease, no layer announced.
    assert values.get("splitserve_kv_streamed_layers_total|llm", 0.0) == 0
    assert values.get("splitserve_kv_handoff_seconds_total|llm", 0.0) == 0
    wait_until(lambda: is_idle(decode, "llm"), 30, "decode idle")
    wait_until(lambda: is_idle(cluster["prefill0"], "prefill"), 30, "prefill idle")


def test_prefill_killed_mid_push_ends_the_request_and_frees_its_blocks(
    nodes: tuple[netns.Cluster, dict[str, Server]],
) -> None:
    cluster, servers = nodes
    decode, prefill = cluster["decode"], cluster["prefill0"]
    metrics = f"http://{prefill.address}:8002/metrics"
    args = ["midstream", "127.0.0.1:8001", metrics, prompt(1), str(MAX_TOKENS), PUSHED]
    request = decode.popen([sys.executable, str(CLIENT), *args], stdout=subprocess.PIPE, text=True)
    assert request.stdout is not None
    assert request.stdout.readline().strip() == "pulling"
    servers["prefill0"].kill_node()
    out, _ = request.communicate(timeout=90)
    result = json.loads(out)
    assert "error" in result and "prefill" in result["error"], result
    values = gauges(decode)
    assert values["splitserve_kv_push_failures_total|llm"] == 1
    # Its blocks were quarantined (a dead prefill sends no "settled"): back once no WRITE can
    # land, at the target's expiry plus the transfer timeout.
    wait_until(lambda: is_idle(decode, "llm"), TARGET_TTL_S + 30, "decode holds nothing")
    assert gauges(decode)["splitserve_kv_blocks_quarantined|llm"] == 0
