"""The network-namespace harness (netns.py): reachability, link faults, shaping, cleanup.

Skips, with the reason, where namespaces cannot be made (not root, no iproute2, a sandbox).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import netns
import pytest
from netns import Cluster, Node

# Accepts forever; answers each connection with the node's name. Prints its port when ready.
SERVER = """
import socket, sys
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", 0))
srv.listen(16)
print(srv.getsockname()[1], flush=True)
while True:
    conn, _ = srv.accept()
    conn.sendall(sys.argv[1].encode())
    conn.close()
"""

# Connects to each host:port given, prints what it read or the error.
CLIENT = """
import socket, sys
timeout = float(sys.argv[1])
for target in sys.argv[2:]:
    host, port = target.split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            print(sock.recv(64).decode(), flush=True)
    except OSError as exc:
        print("error", type(exc).__name__, flush=True)
"""

# Holds one connection open; sends a line each time one arrives on stdin, prints the reply.
HOLDER = """
import socket, sys
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
print("connected", flush=True)
for line in sys.stdin:
    sock.sendall(line.encode())
    print(sock.recv(64).decode().strip(), flush=True)
"""

ECHO = """
import socket
srv = socket.socket()
srv.bind(("0.0.0.0", 0))
srv.listen(1)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
while data := conn.recv(64):
    conn.sendall(data)
"""


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    reason = netns.available()
    if reason is not None:
        pytest.skip(reason)
    with Cluster(["prefill0", "prefill1", "decode"]) as c:
        yield c


def start(node: Node, script: str, *args: str) -> tuple[subprocess.Popen[str], str]:
    """``script`` in ``node``; returns the process and the port its first line names."""
    proc = node.popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def connect(node: Node, targets: list[str], timeout: float = 2.0) -> list[str]:
    done = node.run([sys.executable, "-c", CLIENT, str(timeout), *targets], timeout=30)
    lines: list[str] = done.stdout.splitlines()
    return lines


@pytest.fixture(scope="module")
def servers(cluster: Cluster) -> Iterator[dict[str, str]]:
    """A name server in every node: node name -> "address:port"."""
    procs = {n.name: start(n, SERVER, n.name) for n in cluster}
    yield {name: f"{cluster[name].address}:{port}" for name, (_, port) in procs.items()}
    for proc, _ in procs.values():
        proc.kill()
        proc.wait()


def test_every_node_reaches_every_other(cluster: Cluster, servers: dict[str, str]) -> None:
    for node in cluster:
        others = [n.name for n in cluster if n is not node]
        assert connect(node, [servers[o] for o in others]) == others


def test_nodes_exist_only_inside_namespaces(cluster: Cluster) -> None:
    # No packet is sent from the root namespace: its default route leads off this machine.
    root_addrs = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    root_routes = subprocess.run(
        ["ip", "route", "show", "table", "all"], capture_output=True, text=True
    ).stdout
    subnet_prefix = str(cluster.subnet.network_address).rsplit(".", 1)[0] + "."
    assert subnet_prefix not in root_addrs
    assert subnet_prefix not in root_routes
    for node in cluster:
        route = subprocess.run(
            ["ip", "route", "get", node.address], capture_output=True, text=True
        ).stdout
        assert node.bridge_port not in route and "br0" not in route
        # Inside, a node sees only its loopback and its one veth end.
        links = node.run(["ip", "-o", "link"]).stdout
        assert [line.split(":")[1].strip().split("@")[0] for line in links.splitlines()] == [
            "lo",
            "eth0",
        ]


def test_link_down_cuts_one_node_and_up_restores_it(
    cluster: Cluster, servers: dict[str, str]
) -> None:
    prefill0, prefill1, decode = cluster["prefill0"], cluster["prefill1"], cluster["decode"]
    echo, port = start(decode, ECHO)
    holder, _ = start(prefill0, HOLDER, decode.address, port)
    assert holder.stdin is not None and holder.stdout is not None
    try:
        holder.stdin.write("before\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "before"

        netns.link_down(prefill0)
        try:
            began = time.monotonic()
            out = connect(prefill0, [servers["decode"], servers["prefill1"]], timeout=1.0)
            assert all(line.startswith("error") for line in out), out
            assert time.monotonic() - began < 5.0
            # Only prefill0 is cut off.
            assert connect(prefill1, [servers["decode"]]) == ["decode"]
            # Sent while down: stays queued in TCP until the link returns.
            holder.stdin.write("during\n")
            holder.stdin.flush()
            time.sleep(0.3)
        finally:
            netns.link_up(prefill0)

        assert connect(prefill0, [servers["decode"], servers["prefill1"]]) == [
            "decode",
            "prefill1",
        ]
        # The established connection resumes (one TCP retransmit, < ~1 s).
        assert holder.stdout.readline().strip() == "during"
    finally:
        for proc in (holder, echo):
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("direction", ["into", "out of"])
def test_set_rate_caps_tcp_throughput(cluster: Cluster, direction: str) -> None:
    decode, prefill0 = cluster["decode"], cluster["prefill0"]
    server, client = (decode, prefill0) if direction == "into" else (prefill0, decode)
    netns.set_rate(decode, 0.1)
    try:
        gbit = netns.python_throughput(server, client, seconds=1.5)
    finally:
        netns.set_rate(decode, None)
    # Measured here: 0.096 (TCP/IP/Ethernet headers are ~4.5 % of each 1514-byte frame).
    assert 0.075 <= gbit <= 0.125, f"{gbit:.3f} Gbit/s {direction} a 0.1 Gbit/s node"


def test_set_rate_none_lifts_the_cap(cluster: Cluster) -> None:
    decode, prefill0 = cluster["decode"], cluster["prefill0"]
    netns.set_rate(decode, 0.1)
    netns.set_rate(decode, None)
    assert netns.python_throughput(decode, prefill0, seconds=0.5) > 0.5
    qdiscs = decode.run(["tc", "qdisc", "show", "dev", "eth0"]).stdout
    assert "tbf" not in qdiscs


def _root_veths() -> set[str]:
    out = subprocess.run(
        ["ip", "-o", "link", "show", "type", "veth"], capture_output=True, text=True
    ).stdout
    return {line.split(":")[1].strip() for line in out.splitlines()}


def test_nothing_left_behind_even_after_a_failure() -> None:
    reason = netns.available()
    if reason is not None:
        pytest.skip(reason)
    veths_before = _root_veths()
    names: list[str] = []
    sleeper: subprocess.Popen[bytes] | None = None
    with pytest.raises(RuntimeError, match="inside the block"), Cluster(["a", "b"]) as c:
        names = c.netns_names
        assert set(names) <= set(netns.list_netns())
        sleeper = c["a"].popen(["sleep", "60"])
        raise RuntimeError("inside the block")
    assert sleeper is not None and sleeper.wait(timeout=5) != 0
    assert not set(names) & set(netns.list_netns())
    assert _root_veths() == veths_before


def test_sweep_stale_removes_namespaces_of_dead_creators() -> None:
    reason = netns.available()
    if reason is not None:
        pytest.skip(reason)
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = f"ss-{dead.pid}-00000000-orphan"
    subprocess.run(["ip", "netns", "add", orphan], check=True)
    try:
        assert orphan in netns.sweep_stale()
        assert orphan not in netns.list_netns()
    finally:
        subprocess.run(["ip", "netns", "del", orphan], capture_output=True)
