"""Prefill and decode as separate servers on separate "nodes": network namespaces of this
machine joined by a bridge (``netns``), KV over NIXL with UCX's TCP transport only, prefill
reached over Triton gRPC. Every server is a real ``splitserve serve --role ...`` process; every
client call runs inside the decode node (``multinode_client.py``), the only place its ports
are reachable from.

The servers start once for the module; the tests run in file order and the last ones kill
nodes: greedy text, cancellation, a cut link, a killed prefill node, a killed decode node.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import netns
import pytest
from llm_client import MAX_MODEL_LEN, ReferenceFactory
from multinode_servers import (
    CLIENT,
    SPLITSERVE,
    Server,
    client,
    gauges,
    is_idle,
    server_args,
    wait_until,
)

pytestmark = pytest.mark.triton
pytest.importorskip("nixl._api", reason="NIXL is not installed (pip install nixl-cu12)")

LEASE_TTL_S = 3.0
TRANSFER_TIMEOUT_S = 3.0
CALL_TIMEOUT_S = 10.0
START_TIMEOUT_S = 240.0
PROMPTS = ("The quick brown fox", "def fibonacci(n: int) -> int:", "Splitserve across nodes")
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def cluster() -> Iterator[netns.Cluster]:
    reason = netns.available()
    if reason is not None:
        pytest.skip(reason)
    with netns.Cluster(("prefill0", "prefill1", "decode")) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def servers(
    cluster: netns.Cluster, serve_ckpt: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Server]]:
    tmp = tmp_path_factory.mktemp("multinode")
    common = [*server_args(serve_ckpt, tmp), "--transport", "nixl"]
    started: dict[str, Server] = {}
    try:
        # A mixed fleet: prefill1 streams its KV by layer (the default; here for short prompts
        # too, each layer announced alone), prefill0 hands it over after the pass; the decode
        # server learns which is which.
        stream = "--kv-stream-layers --param kv_stream_min_tokens=0 --param kv_stream_min_gap_s=0"
        for name, mode in (("prefill0", "--no-kv-stream-layers"), ("prefill1", stream)):
            node = cluster[name]
            started[name] = Server(
                node,
                tmp / f"{name}.log",
                [*common, "--role", "prefill", "--advertise-host", node.address, *mode.split(),
                 "--param", f"lease_ttl_s={LEASE_TTL_S}"],
            )  # fmt: skip
        decode = cluster["decode"]
        urls = [f"--prefill-url={cluster[n].address}:8001" for n in ("prefill0", "prefill1")]
        started["decode"] = Server(
            decode,
            tmp / "decode.log",
            [*common, "--role", "decode", "--advertise-host", decode.address, *urls,
             "--openai-port", "9000", "--host", "0.0.0.0",
             "--param", f"kv_transfer_timeout_s={TRANSFER_TIMEOUT_S}",
             "--param", f"prefill_call_timeout_s={CALL_TIMEOUT_S}"],
        )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT_S
        for server in started.values():
            server.wait_ready(deadline)
        yield started
    finally:
        for server in started.values():
            server.stop()


def all_idle(cluster: netns.Cluster, alive: tuple[str, ...]) -> bool:
    models = {"decode": "llm", "prefill0": "prefill", "prefill1": "prefill"}
    return all(is_idle(cluster[name], models[name]) for name in alive)


def test_greedy_text_across_nodes_equals_transformers(
    cluster: netns.Cluster,
    servers: dict[str, Server],
    greedy_reference: ReferenceFactory,
    serve_ckpt: Path,
    tmp_path: Path,
) -> None:
    decode = cluster["decode"]
    for prompt in PROMPTS * 2:  # twice: both prefill nodes serve some
        ref = greedy_reference(prompt, MAX_TOKENS, True)
        got = client(decode, "generate", "127.0.0.1:8001", prompt, MAX_TOKENS, "1")
        assert got.get("text") == ref.text, (prompt, got)
    values = gauges(decode)
    assert values["splitserve_kv_handoff_failures|llm"] == 0
    # Those prefilled by prefill1 streamed by layer, each layer pulled as it was announced.
    streamed = values["splitserve_kv_streamed_requests_total|llm"]
    assert 0 < streamed < len(PROMPTS) * 2, values
    layers = values["splitserve_kv_streamed_layers_total|llm"]
    assert layers > 0 and layers % streamed == 0, values
    ref = greedy_reference(PROMPTS[0], MAX_TOKENS, True)
    # The client tools of a single server (generate, the OpenAI frontend, bench) work unchanged
    # against a decode server.
    cli = decode.run(
        [str(SPLITSERVE), "generate", PROMPTS[0], "--max-tokens", str(MAX_TOKENS),
         "--ignore-eos", "--url", "127.0.0.1:8001"],
        timeout=120,
    )  # fmt: skip
    assert ref.text in cli.stdout, cli.stdout
    completion = client(decode, "openai", "http://127.0.0.1:9000", PROMPTS[0], 8)
    assert completion["choices"][0]["text"], completion
    report = tmp_path / "bench.json"
    decode.run(
        [str(SPLITSERVE), "bench", "--url", "127.0.0.1:8001", "--workload", "fixed",
         "--input-len", "24", "--output-len", "8", "--tokenizer", str(serve_ckpt),
         "--max-model-len", str(MAX_MODEL_LEN), "--rate", "8", "--num-requests", "8",
         "--json", str(report), "--no-progress"],
        timeout=120,
    )  # fmt: skip
    (summary,) = json.loads(report.read_text())["summary"]
    assert (summary["num_requests"], summary["errors"]) == (8, 0), summary
    for name in ("prefill0", "prefill1"):
        wait_until(lambda n=name: is_idle(cluster[n], "prefill"), 30, f"{name} idle")


def test_cancelled_stream_leaves_nothing_on_either_node(
    cluster: netns.Cluster, servers: dict[str, Server]
) -> None:
    decode = cluster["decode"]
    for i in range(3):
        got = client(decode, "cancel", "127.0.0.1:8001", f"cancel me {i}")
        assert got["events"] == 2 and not got["errors"], got
    alive = ("decode", "prefill0", "prefill1")
    wait_until(lambda: all_idle(cluster, alive), 30, "0 blocks and 0 leases on every node")


def test_link_cut_mid_transfer_ends_requests_and_leaks_nothing(
    cluster: netns.Cluster, servers: dict[str, Server]
) -> None:
    decode, prefill0 = cluster["decode"], cluster["prefill0"]
    before = gauges(decode)["splitserve_kv_handoff_failures|llm"]
    granted = gauges(prefill0)["splitserve_leases_granted_total|prefill"]
    # ~3 MB of KV per request at 1.25 MB/s: the first transfer from prefill0 takes over 2 s,
    # and the link goes down as soon as prefill0 has handed a request over.
    netns.set_rate(prefill0, 0.01)
    load = decode.popen(
        [sys.executable, str(CLIENT), "load", "127.0.0.1:8001", "8", "8", "90", "1000"],
        stdout=subprocess.PIPE,
        text=True,
    )
    wait_until(
        lambda: gauges(prefill0)["splitserve_leases_granted_total|prefill"] > granted,
        60,
        "a handoff from prefill0",
    )
    netns.link_down(prefill0)
    started = time.monotonic()
    out, _ = load.communicate(timeout=150)
    ended_in = time.monotonic() - started
    netns.link_up(prefill0)
    netns.set_rate(prefill0, None)
    results = json.loads(out)
    # Each request ended: with text (prefilled by prefill1 after a failover) or with an error
    # (its transfer abandoned at kv_transfer_timeout_s: a decode server's default policy).
    assert all(r is not None and ("text" in r or "error" in r) for r in results), results
    assert ended_in < 90
    abandoned = gauges(decode)["splitserve_kv_handoff_failures|llm"] - before
    assert abandoned > 0, "no transfer was in flight when the link went down"
    lost = [r["error"] for r in results if "could not be pulled" in r.get("error", "")]
    assert len(lost) == abandoned, results
    for i in range(4):  # the next requests succeed; their fetches return the held blocks
        got = client(decode, "generate", "127.0.0.1:8001", f"after the cut {i}", 8)
        assert "text" in got, got
    alive = ("decode", "prefill0", "prefill1")
    wait_until(lambda: all_idle(cluster, alive), LEASE_TTL_S + 60, "nothing leaked")


def test_killed_prefill_node_under_load_fails_over(
    cluster: netns.Cluster, servers: dict[str, Server], greedy_reference: ReferenceFactory
) -> None:
    decode = cluster["decode"]
    n, words = 12, 150
    load = decode.popen(
        [sys.executable, str(CLIENT), "load", "127.0.0.1:8001", str(n), "16", "60", str(words)],
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.0)
    servers["prefill1"].kill_node()  # passes are under way there, their layers streaming
    out, _ = load.communicate(timeout=120)
    results = json.loads(out)
    # Each request ends: with the text transformers gives (no half-streamed KV was decoded),
    # or with an error (its prefill died mid-stream).
    for i, result in enumerate(results):
        assert result is not None and ("text" in result or "error" in result), results
        if "text" in result:
            ref = greedy_reference(f"request {i} of the load{' lorem' * words}", 16, True)
            assert result["text"] == ref.text, (i, result)
    for i in range(6):  # new requests go to the survivor
        got = client(decode, "generate", "127.0.0.1:8001", f"survivor {i}", 8)
        assert "text" in got, got
    assert gauges(decode)["splitserve_prefill_failovers_total|llm"] > 0
    wait_until(lambda: all_idle(cluster, ("decode", "prefill0")), 60, "nothing leaked")


def test_killed_decode_node_lets_prefill_leases_expire(
    cluster: netns.Cluster, servers: dict[str, Server]
) -> None:
    decode, prefill0 = cluster["decode"], cluster["prefill0"]
    granted = gauges(prefill0).get("splitserve_leases_granted_total|prefill", 0)
    load = decode.popen(
        [sys.executable, str(CLIENT), "load", "127.0.0.1:8001", "8", "64", "60"],
        stdout=subprocess.DEVNULL,
    )
    wait_until(
        lambda: (
            gauges(prefill0).get("splitserve_leases_granted_total|prefill", 0) > granted
            or load.poll() is not None
        ),
        60,
        "handoffs under way",
    )
    servers["decode"].kill_node()
    load.wait(30)
    # Pulled leases last the reader's transfer timeout plus a margin (default 10 + 5 s).
    wait_until(lambda: is_idle(prefill0, "prefill"), 45, "prefill leases expired")
