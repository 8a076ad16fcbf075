"""KV handoff over NIXL against the plain-TCP ceiling of the same link, between two network
namespaces (tests/integration/netns.py), at link rates limited by tc.

For each rate: iperf3's TCP goodput prefill0 -> decode (the ceiling), then the NIXL transport
(UCX over TCP only) moving the KV of 128, 1k and 4k prompt tokens of the 100m checkpoint
(bfloat16: 12 layers x 4 KV heads x 64 dims, K and V: 12 KiB per token) from an owner in prefill0
into a reader in decode, ``--repeats`` times each: ``splitserve plan link serve`` and
``splitserve plan link measure``, what a user runs between two real hosts. Prints, per rate and
length, the median handoff time (what the transfer adds after the prompt pass: decode streams
the first token at once and starts the next step once the blocks are in) and the handoff rate as
a fraction of the ceiling. Needs root and iperf3 (``apt-get install -y iperf3``).

Run: python scripts/bench_link.py [--rates unlimited,10,1] [--repeats 5] [--json out/link.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from link_ceiling import iperf3_ceiling, parse_rates

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
import netns

from splitserve.transport.key import generate_key, key_environ

SPLITSERVE = Path(sys.executable).with_name("splitserve")
PORT = 5701


def handoffs(cluster: netns.Cluster, repeats: int, encoding: str) -> list[dict[str, Any]]:
    """``splitserve plan link serve`` in prefill0, ``... measure`` in decode: one row per
    length (128, 1k, 4k tokens), the median of ``repeats`` handoffs."""
    env = {**os.environ, "UCX_TLS": "tcp", **key_environ(generate_key())}
    owner_node, reader_node = cluster["prefill0"], cluster["decode"]
    owner = owner_node.popen(
        [str(SPLITSERVE), "plan", "link", "serve", "--host", owner_node.address,
         "--port", str(PORT), "--kv-transfer-dtype", encoding],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert owner.stdout is not None
        for line in owner.stdout:  # NIXL logs its start-up on stdout too
            if line.startswith("link owner at "):
                break
        else:
            raise RuntimeError("the link owner did not start")
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "link.json"
            done = reader_node.run(
                [str(SPLITSERVE), "plan", "link", "measure",
                 f"tcp://{owner_node.address}:{PORT}", "--repeats", str(repeats),
                 "--host", reader_node.address, "--out", str(out)],
                env=env, timeout=600, check=False,
            )  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(f"plan link measure ({encoding}) failed:\n{done.stderr[-3000:]}")
            rows: list[dict[str, Any]] = json.loads(out.read_text())
            return rows
    finally:
        owner.kill()
        owner.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="unlimited,10,1")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=5.0, help="iperf3 run length")
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--kv-transfer-dtype",
        default="auto",
        help="comma-separated encodings to measure each (auto, fp8): fp8 rows move e4m3 and "
        "count the owner's encoding in their time",
    )
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
            for encoding in args.kv_transfer_dtype.split(","):
                for h in handoffs(cluster, args.repeats, encoding):
                    rows.append({**h, "rate_gbit": rate, "tcp_gbit_s": ceiling})
                    print(
                        f"link {'unlimited' if rate is None else f'{rate:g} Gbit/s':>10}  "
                        f"TCP {ceiling:6.2f} Gbit/s  {h['tokens']:5d} tokens  "
                        f"{h['bytes'] / 2**20:6.1f} MiB as {h['wire_bytes'] / 2**20:5.1f} MiB "
                        f"{h['encoding']:4s} in {h['seconds'] * 1e3:8.1f} ms (export "
                        f"{h['export_seconds'] * 1e3:5.1f})  = {h['gbit_s']:6.2f} Gbit/s of KV "
                        f"({h['gbit_s'] / ceiling:.2f} of TCP)",
                        flush=True,
                    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
