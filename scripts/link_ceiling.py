"""Plain-TCP ceiling of a link between two "nodes" of the network-namespace harness.

Builds two namespaces (``prefill0``, ``decode``) on a bridge with tests/integration/netns.py,
caps both nodes' links at each rate in turn (tbf; "unlimited" is none) and measures one TCP
stream prefill0 -> decode, the direction a KV handoff takes: ``iperf3`` (server in decode, ``-J``
client in prefill0), or Python sockets with ``--python``. Prints a table. Needs root.

The measured figure is goodput: at a tbf rate R expect ~0.956 R, since the Ethernet, IP and TCP
headers are 66 of every 1514 bytes on the wire.

Run: python scripts/link_ceiling.py [--seconds 5] [--rates unlimited,10,1] [--python]
Exit 2: iperf3 missing (``apt-get install -y iperf3``) or namespaces unusable here.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

# The harness is a test helper, not a package: import it from its directory.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
import netns
from netns import Node

IPERF_PORT = 5201  # inside the namespaces only: no clash with anything on the host


def _wait_listening(node: Node, port: int, proc: subprocess.Popen[str], timeout: float) -> None:
    """Until ``port`` listens in ``node`` (checked with ``ss``: a probe connection would count
    as iperf3's one client)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"iperf3 server exited: {proc.communicate()[1].strip()}")
        listening = node.run(["ss", "-Hltn", f"sport = :{port}"]).stdout
        if listening.strip():
            return
        time.sleep(0.05)
    raise RuntimeError(f"iperf3 server not listening after {timeout} s")


def iperf3_ceiling(server_node: Node, client_node: Node, seconds: float) -> float:
    """Gbit/s received by ``server_node`` from one iperf3 TCP stream, first second omitted."""
    server = server_node.popen(
        ["iperf3", "-s", "-1", "-p", str(IPERF_PORT)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_listening(server_node, IPERF_PORT, server, timeout=10)
        target = ["-c", server_node.address, "-p", str(IPERF_PORT)]
        timing = ["-t", str(max(1, round(seconds))), "-O", "1"]  # the first second omitted
        client = client_node.run(
            ["iperf3", *target, *timing, "-J"], check=False, timeout=seconds + 30
        )
        report = json.loads(client.stdout or "{}")
        if client.returncode != 0 or "error" in report:
            raise RuntimeError(f"iperf3 client failed: {report.get('error', client.stderr)}")
        server.wait(timeout=10)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    return float(report["end"]["sum_received"]["bits_per_second"]) / 1e9


def tcp_ceiling(
    server_node: Node, client_node: Node, seconds: float, *, python: bool = False
) -> float:
    """Gbit/s of one TCP stream ``client_node`` -> ``server_node`` (iperf3, or Python sockets)."""
    if python:
        return netns.python_throughput(server_node, client_node, seconds)
    return iperf3_ceiling(server_node, client_node, seconds)


def parse_rates(text: str) -> list[float | None]:
    return [None if r.strip() == "unlimited" else float(r) for r in text.split(",")]


def exit_on_sigterm(signum: int, frame: object) -> NoReturn:
    # SystemExit unwinds through the Cluster's context manager: namespaces are removed.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="per rate (default 5)")
    ap.add_argument("--rates", default="unlimited,10,1", help="Gbit/s, comma separated")
    ap.add_argument("--python", action="store_true", help="Python sockets instead of iperf3")
    args = ap.parse_args(argv)
    rates = parse_rates(args.rates)

    if not args.python and shutil.which("iperf3") is None:
        print("iperf3 is not installed: apt-get install -y iperf3 (or pass --python)")
        return 2
    reason = netns.available()
    if reason is not None:
        print(f"network namespaces unusable here: {reason}")
        return 2

    signal.signal(signal.SIGTERM, exit_on_sigterm)
    tool = "python" if args.python else "iperf3"
    print(f"{'set Gbit/s':>12} {'measured Gbit/s':>16} {'of set':>8}  tool")
    with netns.Cluster(["prefill0", "decode"]) as cluster:
        prefill, decode = cluster["prefill0"], cluster["decode"]
        for rate in rates:
            for node in cluster:
                netns.set_rate(node, rate)
            gbit = tcp_ceiling(decode, prefill, args.seconds, python=args.python)
            share = "" if rate is None else f"{gbit / rate:.1%}"
            label = "unlimited" if rate is None else f"{rate:g}"
            print(f"{label:>12} {gbit:>16.3f} {share:>8}  {tool}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
