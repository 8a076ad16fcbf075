"""Several "nodes" on one machine: Linux network namespaces joined by a bridge.

Each node is a namespace ``<prefix><name>`` with one interface, ``eth0``, whose veth peer
``p<i>`` is a port of bridge ``br0`` in its own namespace ``<prefix>bridge``; every node reaches
every other one on a private /24. Nothing is created in the root namespace: no address, no route,
no veth. Shaping (``set_rate``) puts a tbf qdisc on the egress of both ends of a node's veth;
``link_down`` takes the bridge end down, so the node sees carrier loss and its packets are
dropped (a pulled cable: connects time out, established connections stall and resume).

Namespaces share the host's filesystem, /dev/shm included: a shared-memory transport works
across these "nodes" where it would not across machines, so tests of the network path must
force the TCP transport.

Used by integration tests and by scripts/link_ceiling.py: no pytest here, nothing at import.
Needs root and iproute2 (``ip``, ``tc``); ``available()`` says why not otherwise.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import ipaddress
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

__all__ = [
    "Cluster",
    "Node",
    "available",
    "link_down",
    "link_up",
    "list_netns",
    "python_throughput",
    "set_rate",
    "sweep_stale",
]

# ss-<creating pid>-<random hex>-<node name>; the pid lets sweep_stale() find orphans.
PREFIX_RE = re.compile(r"^ss-(\d+)-([0-9a-f]+)-")
BRIDGE = "br0"
NODE_IF = "eth0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """One iproute2 command (``ip`` or ``tc``); a failure raises with its stderr."""
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {done.stderr.strip()}")
    return done


@functools.cache
def _ip_path() -> str:
    """``ip`` by full path: a caller's ``env`` without /usr/sbin on PATH still finds it."""
    return shutil.which("ip") or "/usr/sbin/ip"


@dataclass
class Node:
    """One namespace: ``name`` (e.g. "decode"), ``netns`` (its namespace), ``address`` (IPv4)."""

    name: str
    netns: str
    address: str
    bridge_netns: str
    bridge_port: str  # this node's veth end in the bridge namespace
    ifname: str = NODE_IF  # its end inside the node
    rate_gbit: float | None = field(default=None, init=False)

    def argv(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` run inside this namespace (for callers that start processes themselves)."""
        return [_ip_path(), "netns", "exec", self.netns, *cmd]

    def popen(
        self, cmd: Sequence[str], env: Mapping[str, str] | None = None, **kw: Any
    ) -> subprocess.Popen[Any]:
        """Start ``cmd`` in this namespace. ``ip netns exec`` execs it, so the pid is its own."""
        return subprocess.Popen(self.argv(cmd), env=None if env is None else dict(env), **kw)

    def run(
        self,
        cmd: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        check: bool = True,
        timeout: float | None = 60.0,
        **kw: Any,
    ) -> subprocess.CompletedProcess[Any]:
        """Run ``cmd`` to completion in this namespace; output captured as text by default."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(
            self.argv(cmd),
            env=None if env is None else dict(env),
            check=check,
            timeout=timeout,
            **kw,
        )


def _used_subnets() -> set[str]:
    """10.213.X prefixes of the root namespace's addresses and routes."""
    text = _ip("ip", "-o", "addr").stdout + _ip("ip", "route", "show", "table", "all").stdout
    return set(re.findall(r"\b10\.213\.(\d+)\.", text))


def _pick_subnet() -> ipaddress.IPv4Network:
    used = _used_subnets()
    free = [x for x in range(256) if str(x) not in used]
    if not free:
        raise RuntimeError("every 10.213.X.0/24 is in use in the root namespace")
    return ipaddress.IPv4Network(f"10.213.{random.choice(free)}.0/24")


def list_netns() -> list[str]:
    """Names of all namespaces (``ip netns list``)."""
    # Lines look like "ss-1-ab-decode (id: 3)" or just the name.
    return [line.split()[0] for line in _ip("ip", "netns", "list").stdout.splitlines() if line]


def _kill_and_delete(netns: str) -> None:
    """Stop every process in ``netns`` (TERM, then KILL after 1 s), then delete it."""
    for sig, grace in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 2.0)):
        pids = _pids(netns)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            time.sleep(0.02)
            pids = _pids(netns)
        if not pids:
            break
    _ip("ip", "netns", "del", netns, check=False)


def _pids(netns: str) -> list[int]:
    done = _ip("ip", "netns", "pids", netns, check=False)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete harness namespaces whose creating process is gone; returns their names."""
    swept = []
    for name in list_netns():
        match = PREFIX_RE.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _kill_and_delete(name)
            swept.append(name)
    return swept


@functools.cache
def available() -> str | None:
    """None if namespaces, veths, a bridge and tbf work here; else why not (for pytest.skip)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"ss-{os.getpid()}-{random.getrandbits(32):08x}-probe"
    try:
        _ip("ip", "netns", "add", probe)
        _ip("ip", "-n", probe, "link", "add", BRIDGE, "type", "bridge")
        _ip("ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        _ip("tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", *_tbf_args(1.0))
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot build a namespace with a veth, a bridge and tbf: {exc}"
    finally:
        _ip("ip", "netns", "del", probe, check=False)
    return None


class Cluster:
    """N nodes on one bridge; a context manager, also torn down at exit.

    ``Cluster(["prefill0", "prefill1", "decode"])``; ``cluster["decode"]`` or ``cluster.nodes``.
    ``mtu`` 9000 models a jumbo-frame fabric (fewer, larger packets per byte moved).
    """

    def __init__(
        self, names: Sequence[str] = ("prefill0", "prefill1", "decode"), mtu: int = 1500
    ) -> None:
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"node names must be distinct and non-empty: {names}")
        for name in names:
            if not re.fullmatch(r"[A-Za-z0-9_.-]{1,32}", name):
                raise ValueError(f"bad node name {name!r}")
        sweep_stale()
        self.prefix = f"ss-{os.getpid()}-{random.getrandbits(32):08x}-"
        self.subnet = _pick_subnet()
        self.bridge_netns = self.prefix + "bridge"
        self.mtu = mtu
        self.nodes: list[Node] = []
        self._created: list[str] = []
        self._closed = False
        atexit.register(self.close)
        try:
            self._build(names)
        except BaseException:
            self.close()
            raise

    def _add_netns(self, netns: str) -> None:
        _ip("ip", "netns", "add", netns)
        self._created.append(netns)
        _ip("ip", "-n", netns, "link", "set", "lo", "up")

    def _build(self, names: Sequence[str]) -> None:
        br = self.bridge_netns
        self._add_netns(br)
        # forward_delay 0: ports forward as soon as they are up (STP is off by default).
        _ip("ip", "-n", br, "link", "add", BRIDGE, "type", "bridge", "forward_delay", "0")
        _ip("ip", "-n", br, "link", "set", BRIDGE, "up")
        hosts = self.subnet.hosts()
        for i, name in enumerate(names):
            node = Node(
                name=name,
                netns=self.prefix + name,
                address=str(next(hosts)),
                bridge_netns=br,
                bridge_port=f"p{i}",
            )
            self._add_netns(node.netns)
            # Created inside the bridge namespace, the peer moved straight into the node's.
            mtu = str(self.mtu)
            _ip(
                "ip", "-n", br, "link", "add", node.bridge_port, "mtu", mtu, "type", "veth",
                "peer", "name", NODE_IF, "mtu", mtu, "netns", node.netns,
            )  # fmt: skip
            _ip("ip", "-n", br, "link", "set", node.bridge_port, "master", BRIDGE, "up")
            cidr = f"{node.address}/{self.subnet.prefixlen}"
            _ip("ip", "-n", node.netns, "addr", "add", cidr, "dev", NODE_IF)
            _ip("ip", "-n", node.netns, "link", "set", NODE_IF, "up")
            # ARP resends every 100 ms, not 1 s: a peer tried while the link was down is
            # resolved within ~0.1 s of link_up instead of up to a second later.
            _ip("ip", "-n", node.netns, "ntable", "change", "name", "arp_cache", "dev", NODE_IF,
                "retrans", "100")  # fmt: skip
            self.nodes.append(node)

    def __getitem__(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Kill what runs in the nodes, delete every namespace (and with them the veths)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for netns in reversed(self._created):
            _kill_and_delete(netns)

    @property
    def netns_names(self) -> list[str]:
        return list(self._created)


def _tbf_args(gbit: float) -> list[str]:
    """tbf at ``gbit``. A burst under ~1 ms at the rate undershoots (measured: 16 KiB at 10
    Gbit/s gave 33-48 % of it, 3000 B at 1 Gbit/s 71-75 %); the 128 KiB floor also holds a whole
    64 KiB GSO packet, which tbf would otherwise split. ``latency`` bounds the queue."""
    rate = int(gbit * 1e9)
    burst = max(rate // 8 // 1000, 128 * 1024)
    return ["tbf", "rate", f"{rate}bit", "burst", str(burst), "latency", "20ms"]


def set_rate(node: Node, gbit: float | None) -> None:
    """Cap ``node``'s link at ``gbit`` Gbit/s each way (tbf on both veth ends); None: no cap."""
    ends = ((node.netns, node.ifname), (node.bridge_netns, node.bridge_port))
    for netns, dev in ends:
        if gbit is None:
            if node.rate_gbit is not None:
                _ip("tc", "-n", netns, "qdisc", "del", "dev", dev, "root")
        else:
            if gbit <= 0:
                raise ValueError(f"rate must be positive: {gbit}")
            _ip("tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", *_tbf_args(gbit))
    node.rate_gbit = gbit


def _wait_state(node: Node, up: bool, timeout: float = 5.0) -> None:
    """Wait until both ends report ``state UP`` and the bridge port forwards (or the node's end
    is down). The kernel applies carrier changes from a work item, up to ~1 s late; until then
    packets are dropped, and a connect right after ``link_up`` would wait out a 1 s SYN resend."""
    deadline = time.monotonic() + timeout
    while True:
        inner = _ip("ip", "-n", node.netns, "-o", "link", "show", node.ifname).stdout
        port = _ip("ip", "-d", "-n", node.bridge_netns, "-o", "link", "show", node.bridge_port)
        ready = " state UP " in inner and " state UP " in port.stdout
        ready = ready and "state forwarding" in port.stdout
        if ready == up:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{node.name}: link not {'up' if up else 'down'}: {inner}")
        time.sleep(0.01)


def link_down(node: Node) -> None:
    """Cut ``node`` off the bridge: its end loses carrier, packets either way are dropped."""
    _ip("ip", "-n", node.bridge_netns, "link", "set", node.bridge_port, "down")
    _wait_state(node, up=False)


def link_up(node: Node) -> None:
    """Reconnect ``node``; returns once its end carries traffic again."""
    _ip("ip", "-n", node.bridge_netns, "link", "set", node.bridge_port, "up")
    _wait_state(node, up=True)


# Receiver: prints its port, then {"bytes", "seconds"} counted after a warm-up (tbf's burst and
# TCP slow start out of the figure), up to the sender's EOF.
_SINK = """
import json, socket, sys, time
warm = float(sys.argv[1])
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", 0))
srv.listen(1)
srv.settimeout(30)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.settimeout(30)
buf = bytearray(1 << 20)
start = t0 = None
n = 0
while True:
    k = conn.recv_into(buf)
    now = time.monotonic()
    if not k:
        break
    if start is None:
        start = now
    elif t0 is None and now - start >= warm:
        t0 = now
    elif t0 is not None:
        n += k
print(json.dumps({"bytes": n, "seconds": now - t0 if t0 else 0.0}), flush=True)
"""

_SOURCE = """
import socket, sys, time
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
sock = socket.create_connection((host, port), timeout=10)
buf = memoryview(bytes(1 << 20))
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    sock.sendall(buf)
sock.close()
"""


def python_throughput(server: Node, client: Node, seconds: float, warmup: float = 0.3) -> float:
    """Gbit/s of one TCP stream ``client`` -> ``server`` over ``seconds``, Python sockets."""
    sink = server.popen(
        [sys.executable, "-c", _SINK, str(warmup)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert sink.stdout is not None
        port = sink.stdout.readline().strip()
        if not port:
            raise RuntimeError("throughput sink did not start")
        client.run(
            [sys.executable, "-c", _SOURCE, server.address, port, str(seconds + warmup)],
            timeout=seconds + warmup + 30,
        )
        out, _ = sink.communicate(timeout=30)
    finally:
        if sink.poll() is None:
            sink.kill()
            sink.wait()
    result = json.loads(out)
    moved, seconds = float(result["bytes"]), float(result["seconds"])
    if seconds <= 0:
        raise RuntimeError(f"transfer too short to measure: {result}")
    return moved * 8 / seconds / 1e9
