"""KV pushes (``--kv-push``) from two prefill servers to a decode server, each in a network
namespace of its own, on a checkpoint whose prompt pass (prefill on one core) lasts seconds:
prefill WRITEs each layer into blocks decode reserved and the greedy text equals transformers',
for a prompt of seconds and a short one. A prefill killed halfway through its layers: the
request is pushed again by the other one into other blocks (the same text); with no prefill
left, it ends with a clear error. Either way decode gets the first blocks back once no WRITE
can land in them any more."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
    with prefill_and_decode(slow_ckpt, tmp, fast_metrics, decode, prefills=2) as nodes:
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
    for name in ("prefill0", "prefill1"):
        wait_until(lambda n=name: is_idle(cluster[n], "prefill"), 30, f"{name} idle")


def kill_mid_push(
    nodes: tuple[netns.Cluster, dict[str, Server]], alive: list[str], i: int
) -> tuple[str, Any]:
    """Kill whichever of the ``alive`` prefill servers is pushing prompt ``i`` halfway through
    its layers; which one it was, and the request's result."""
    cluster, servers = nodes
    metrics = ",".join(f"http://{cluster[name].address}:8002/metrics" for name in alive)
    args = ["midstream", "127.0.0.1:8001", metrics, prompt(i), str(MAX_TOKENS), PUSHED]
    request = cluster["decode"].popen(
        [sys.executable, str(CLIENT), *args], stdout=subprocess.PIPE, text=True
    )
    assert request.stdout is not None
    line = request.stdout.readline().split()
    assert line[0] == "pulling", line
    killed = alive[int(line[1])]
    servers[killed].kill_node()
    out, _ = request.communicate(timeout=90)
    return killed, json.loads(out)


def test_a_prefill_killed_mid_push_is_replaced_by_the_other_into_other_blocks(
    nodes: tuple[netns.Cluster, dict[str, Server]], slow_ckpt: Path
) -> None:
    cluster, _ = nodes
    decode = cluster["decode"]
    killed, result = kill_mid_push(nodes, ["prefill0", "prefill1"], 1)
    tokenizer = load_tokenizer(slow_ckpt)
    want = hf_greedy(slow_ckpt, tokenizer.encode(prompt(1)), MAX_TOKENS, eos_token_ids=())
    assert result.get("text") == tokenizer.decode(want), (killed, result)
    values = gauges(decode)
    assert values["splitserve_kv_push_failures_total|llm"] == 1
    assert values["splitserve_prefill_failovers_total|llm"] == 1
    # The first blocks were quarantined (a dead prefill sends no "settled"): back once no WRITE
    # can land, at the target's expiry plus the transfer timeout.
    wait_until(lambda: is_idle(decode, "llm"), TARGET_TTL_S + 30, "decode holds nothing")
    assert gauges(decode)["splitserve_kv_blocks_quarantined|llm"] == 0


def test_the_last_prefill_killed_mid_push_ends_the_request_and_frees_its_blocks(
    nodes: tuple[netns.Cluster, dict[str, Server]],
) -> None:
    cluster, servers = nodes
    decode = cluster["decode"]
    alive = [name for name in ("prefill0", "prefill1") if servers[name].proc.poll() is None]
    assert len(alive) == 1, alive
    _, result = kill_mid_push(nodes, alive, 2)
    assert "error" in result and "prefill" in result["error"], result
    assert gauges(decode)["splitserve_kv_push_failures_total|llm"] >= 2
    wait_until(lambda: is_idle(decode, "llm"), TARGET_TTL_S + 30, "decode holds nothing")
    assert gauges(decode)["splitserve_kv_blocks_quarantined|llm"] == 0
