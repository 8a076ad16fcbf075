"""What posting a pushed prompt's WRITEs costs the thread that runs the prompt pass.

A prefill server that pushes KV by layer calls ``open_push`` before its pass, ``push_layers``
for each run of layers the pass has written, and ``finish_push`` after it, all on its engine
thread. This times those calls (and decode's ``push_arrived``) for a prompt of the 100m
checkpoint's KV shape (bfloat16, 12 layers x 4 KV heads x 64 dims, blocks of 16 tokens) pushed
in ``--runs`` runs, between two NIXL agents in this process over UCX's TCP transport on the
loopback address. Run it on one core (``taskset -c 1``) to see the cost on a prefill core;
what the transfers cost beside the pass (UCX's and the kernel's work on the same core) is not
in these numbers.

Run: taskset -c 1 python scripts/bench_push_post.py [--tokens 128 512] [--runs 3] [--repeats 12]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time

from splitserve.kv.layout import KVLayout
from splitserve.kv.pool import KVPool
from splitserve.transport.key import generate_key
from splitserve.transport.nixl import NixlTransport

LAYOUT = KVLayout(num_layers=12, num_kv_heads=4, head_dim=64, block_size=16, dtype="bfloat16")
POOL_BLOCKS = 600


def runs_of(layers: int, runs: int) -> list[range]:
    """``layers`` split into ``runs`` consecutive runs as even as they go."""
    bounds = [round(i * layers / runs) for i in range(runs + 1)]
    return [range(a, b) for a, b in itertools.pairwise(bounds) if b > a]


def time_pushes(
    prefill: NixlTransport, decode: NixlTransport, tokens: int, runs: int, repeats: int
) -> dict[str, float]:
    """Median seconds of each call over ``repeats`` pushes (after two warm-up ones)."""
    blocks = -(-tokens // LAYOUT.block_size)
    if 2 * blocks > POOL_BLOCKS:
        raise SystemExit(f"bench_push_post: {tokens} tokens do not fit the pools")
    times: dict[str, list[float]] = {"open": [], "push_layers": [], "finish": [], "arrived": []}
    for repeat in range(repeats + 2):
        t0 = time.perf_counter()
        target = decode.push_target(list(range(blocks, 2 * blocks)), tokens)
        key = prefill.open_push(target, list(range(blocks)))
        t1 = time.perf_counter()
        for layers in runs_of(LAYOUT.num_layers, runs):
            prefill.push_layers(key, layers)
        t2 = time.perf_counter()
        prefill.finish_push(key)
        t3 = time.perf_counter()
        decode.push_arrived(target)
        t4 = time.perf_counter()
        if repeat >= 2:
            for name, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                times[name].append(seconds)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--runs", type=int, default=3, help="runs of layers per prompt")
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--dtypes", nargs="+", default=["auto", "fp8"], choices=["auto", "fp8"])
    args = ap.parse_args()
    os.environ.setdefault("UCX_TLS", "tcp")  # as between two hosts
    key, host = generate_key(), "127.0.0.1"
    for dtype in args.dtypes:
        with (
            NixlTransport(key, transfer_dtype=dtype, advertise_host=host) as prefill,
            NixlTransport(
                key, accept_pushes=True, transfer_dtype=dtype, advertise_host=host
            ) as decode,
        ):
            prefill.register(prefill.create_pool(LAYOUT, POOL_BLOCKS))
            decode.register(KVPool(LAYOUT, POOL_BLOCKS))
            for tokens in args.tokens:
                t = time_pushes(prefill, decode, tokens, args.runs, args.repeats)
                print(
                    f"{dtype:>4}  {tokens:5d} tokens in {args.runs} runs:  "
                    + "  ".join(f"{name} {s * 1e3:6.2f} ms" for name, s in t.items()),
                    flush=True,
                )


if __name__ == "__main__":
    main()
