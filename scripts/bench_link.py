"""KV handoff over NIXL against the plain-TCP ceiling of the same link, between two network
namespaces (tests/integration/netns.py), at link rates limited by tc.

For each rate: iperf3's TCP goodput prefill0 -> decode (the ceiling), then the NIXL transport
(UCX over TCP only) moving the KV of 128, 1k and 4k prompt tokens of the 100m checkpoint
(bfloat16: 12 layers x 4 KV heads x 64 dims, K and V: 12 KiB per token) from an owner in prefill0
into a reader in decode, ``--repeats`` times each. Prints, per rate and length, the median
handoff time (what the transfer adds after the prompt pass: decode streams the first token at
once and starts the next step once the blocks are in) and the handoff rate as a fraction of the
ceiling. Needs root and iperf3 (``apt-get install -y iperf3``).

Run: python scripts/bench_link.py [--rates unlimited,10,1] [--repeats 5] [--json out/link.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from link_ceiling import iperf3_ceiling, parse_rates

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
import netns

from splitserve.transport.key import generate_key, key_environ

PEER = Path(__file__).with_name("kv_link_peer.py")
LENGTHS = (128, 1024, 4096)
BLOCKS = 1024  # 16k tokens: room for every length at once


def _peer(node: netns.Node, role: str, env: dict[str, str]) -> subprocess.Popen[str]:
    proc = node.popen(
        [sys.executable, str(PEER), role, node.address, str(BLOCKS)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # NIXL logs its start-up on stdout
        if line.strip() == "ready":
            return proc
    raise RuntimeError(f"{role} did not start")


def _ask(proc: subprocess.Popen[str], line: str) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def handoffs(cluster: netns.Cluster, repeats: int) -> dict[int, dict[str, float]]:
    env = {**os.environ, "UCX_TLS": "tcp", **key_environ(generate_key())}
    owner = _peer(cluster["prefill0"], "owner", env)
    reader = _peer(cluster["decode"], "reader", env)
    try:
        _ask(reader, _ask(owner, "16"))  # connect and fetch metadata outside the timings
        result = {}
        for tokens in LENGTHS:
            times, size = [], 0
            for _ in range(repeats):
                seconds, nbytes = _ask(reader, _ask(owner, str(tokens))).split()
                times.append(float(seconds))
                size = int(nbytes)
            median = statistics.median(times)
            result[tokens] = {"seconds": median, "bytes": size, "gbit_s": size * 8 / median / 1e9}
        return result
    finally:
        for proc in (owner, reader):
            proc.kill()
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="unlimited,10,1")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=5.0, help="iperf3 run length")
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--keep-cwnd",
        action="store_true",
        help="net.ipv4.tcp_slow_start_after_idle=0 in both nodes: a connection idle between "
        "handoffs keeps its congestion window (a common tuning of serving hosts)",
    )
    args = ap.parse_args()
    if (reason := netns.available()) is not None:
        sys.exit(f"bench_link: {reason}")
    rows: list[dict[str, Any]] = []
    with netns.Cluster(("prefill0", "decode")) as cluster:
        if args.keep_cwnd:
            for node in cluster:
                node.run(["sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0"])
        for rate in parse_rates(args.rates):
            for node in cluster:
                netns.set_rate(node, rate)
            ceiling = iperf3_ceiling(cluster["decode"], cluster["prefill0"], args.seconds)
            for tokens, h in handoffs(cluster, args.repeats).items():
                rows.append({"rate_gbit": rate, "tcp_gbit_s": ceiling, "tokens": tokens, **h})
                print(
                    f"link {'unlimited' if rate is None else f'{rate:g} Gbit/s':>10}  "
                    f"TCP {ceiling:6.2f} Gbit/s  {tokens:5d} tokens  "
                    f"{h['bytes'] / 2**20:6.1f} MiB in {h['seconds'] * 1e3:8.1f} ms  "
                    f"= {h['gbit_s']:6.2f} Gbit/s ({h['gbit_s'] / ceiling:.2f} of TCP)",
                    flush=True,
                )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
