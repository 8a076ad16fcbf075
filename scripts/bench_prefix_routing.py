"""Cache-aware prefill routing across servers: two prefill servers and one decode server
(`splitserve serve --role ...`) in three network namespaces (tests/integration/netns.py),
NIXL over TCP, the links limited by tc (10 Gbit/s by default).

Per routing policy of the decode server (``prefix``: a prompt goes to the prefill server that
was sent the longest run of its leading blocks lately, within a load bound; ``least_loaded``:
to the server with the fewest calls in flight), all three servers start fresh and
`splitserve bench` sends the multi-turn workload at one rate from inside the decode namespace.
Printed per policy: the prefix cache hit rate summed over both prefill servers (the clean
measure: on a 2-core machine every latency here is shared-core noise), each server's share of
the prompt tokens, the share of calls routed by prefix, the blocks decode skipped, and TTFT p50
of first and later turns. Written under ``--out``: each run's report and ``summary.json``.
Needs root.

Run: python scripts/bench_prefix_routing.py --out out/prefix_routing [--rate 2]
     [--num-requests 120] [--policies prefix,least_loaded]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_common import checkpoint
from bench_multinode import SPLITSERVE, counters, server_args, serving
from link_ceiling import exit_on_sigterm, netns

MAX_MODEL_LEN = 2048
PREFILLS = ("prefill0", "prefill1")
PREFILL_COUNTERS = ("prefix_cache_queries_total", "prefix_cache_hits_total")
DECODE_COUNTERS = (
    "prefill_calls_total",
    "prefill_routed_by_prefix_total",
    "kv_handoff_blocks_pulled_total",
    "kv_handoff_blocks_skipped_total",
)


def bench(decode: netns.Node, model: str, args: argparse.Namespace, report: Path) -> None:
    argv = [str(SPLITSERVE), "bench", "--url", "127.0.0.1:8001", "--target", "llm",
            "--workload", "multi-turn", "--tokenizer", model,
            "--max-model-len", str(MAX_MODEL_LEN), "--arrival", "poisson",
            "--rate", str(args.rate), "--num-requests", str(args.num_requests),
            "--json", str(report), "--no-progress"]  # fmt: skip
    done = decode.run(argv, timeout=None, check=False, capture_output=False)
    if done.returncode != 0:
        sys.exit(f"splitserve bench failed (exit {done.returncode})")


def ttft_p50(report: Path, later: bool) -> float:
    run = json.loads(report.read_text())["runs"][0]
    ttfts = [r["ttft"] for r in run["requests"] if (r["turn"] > 0) == later and r["ttft"]]
    return statistics.median(ttfts) if ttfts else float("nan")


def one_policy(
    cluster: netns.Cluster, common: list[str], policy: str, args: argparse.Namespace, work: Path
) -> dict[str, Any]:
    decode = cluster["decode"]
    urls = [f"--prefill-url={cluster[name].address}:8001" for name in PREFILLS]
    decode_args = [*common, "--role", "decode", "--decode-cores", args.decode_cores,
                   "--advertise-host", decode.address, *urls,
                   "--param", f"prefill_routing={policy}"]  # fmt: skip
    cores = args.prefill_cores.split(",")
    report = args.out / f"{policy}.json"
    with (
        serving(cluster[PREFILLS[0]], [*common, "--role", "prefill", "--prefill-cores", cores[0],
                                       "--advertise-host", cluster[PREFILLS[0]].address],
                work / f"{policy}-prefill0.log"),
        serving(cluster[PREFILLS[1]], [*common, "--role", "prefill", "--prefill-cores", cores[1],
                                       "--advertise-host", cluster[PREFILLS[1]].address],
                work / f"{policy}-prefill1.log"),
        serving(decode, decode_args, work / f"{policy}-decode.log"),
    ):  # fmt: skip
        bench(decode, args.model_path, args, report)
        per_server = [counters(cluster[name], "prefill", *PREFILL_COUNTERS) for name in PREFILLS]
        calls, by_prefix, pulled, skipped = counters(decode, "llm", *DECODE_COUNTERS)
    queries = sum(q for q, _ in per_server)
    return {
        "policy": policy,
        "hit_rate": sum(h for _, h in per_server) / max(queries, 1),
        "token_share": [q / max(queries, 1) for q, _ in per_server],
        "server_hit_rates": [h / max(q, 1) for q, h in per_server],
        "routed_by_prefix": by_prefix / max(calls, 1),
        "blocks_skipped": skipped / max(pulled + skipped, 1),
        "ttft_p50_first": ttft_p50(report, later=False),
        "ttft_p50_later": ttft_p50(report, later=True),
        "report": str(report),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="100m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rate", type=float, default=2.0, help="requests/s of the workload")
    ap.add_argument("--num-requests", type=int, default=120)
    ap.add_argument("--rate-gbit", type=float, default=10.0)
    ap.add_argument("--policies", default="prefix,least_loaded")
    ap.add_argument("--prefill-cores", default="0,1", help="one core set per prefill server")
    ap.add_argument("--decode-cores", default="1")
    args = ap.parse_args()
    if (reason := netns.available()) is not None:
        sys.exit(f"bench_prefix_routing: {reason}")
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    args.model_path = checkpoint(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-prefix-routing-"))
    common = server_args(args.model_path, args.dtype, MAX_MODEL_LEN, work)
    rows = []
    with netns.Cluster((*PREFILLS, "decode")) as cluster:
        for node in cluster:
            netns.set_rate(node, args.rate_gbit)
        for policy in args.policies.split(","):
            print(f"== {policy} (all servers fresh)", flush=True)
            rows.append(one_policy(cluster, common, policy, args, work))
    print(f"\nmulti-turn at {args.rate:g} req/s, 2 prefill servers + 1 decode, per routing policy")
    print(f"{'policy':>13} {'hit rate':>8} {'token split':>12} {'by prefix':>9} "
          f"{'skipped':>7} {'TTFT p50 first/later ms':>24}")  # fmt: skip
    for r in rows:
        split = "/".join(f"{s:.2f}" for s in r["token_share"])
        print(f"{r['policy']:>13} {r['hit_rate']:8.3f} {split:>12} {r['routed_by_prefix']:9.2f} "
              f"{r['blocks_skipped']:7.2f} {r['ttft_p50_first'] * 1e3:11.0f}/"
              f"{r['ttft_p50_later'] * 1e3:<11.0f}")  # fmt: skip
    (args.out / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
