"""CPU prefill attention: the C++ kernel vs the pure-torch reference vs the matmul roofline.

Causal attention of a prompt of T tokens does 2·T²·heads·head_dim FLOPs (half of the full
QKᵀ and PV products), so its limit is the rate of a large matmul in the same dtype on the same
threads, which the script measures first. Then one layer's attention of one prompt whose blocks
are scattered over a KV pool (as ``splitserve.kv`` lays it out), with the kernel and with the
reference (a gather, then torch's fused attention), side by side. ``--cached N`` puts N tokens
of cached prefix before the prompt (their FLOPs are counted too). Shapes default to the
``100m`` preset (12 heads, 4 KV heads, head dim 64).

Run: python scripts/bench_prefill_attention.py --dtype bfloat16 --threads 1
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from splitserve_kernels import cpu
from splitserve_kernels.reference.attention import paged_prefill_attention as reference
from splitserve_tools.planner.measure import measure_rates


def per_call(fn: Callable[[], object], calls: int) -> float:
    fn()
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 1024, 2048])
    ap.add_argument("--cached", type=int, default=0)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--calls", type=int, default=5, help="best of this many calls per case")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rates = measure_rates("cpu", args.dtype, read_bytes=1 << 28)
    print(
        f"{args.dtype}, {args.threads} thread(s), heads {args.heads}/{args.kv_heads}, "
        f"dim {args.head_dim}, cached {args.cached}; "
        f"matmul {rates.matmul_flops / 1e9:.1f} GFLOP/s; "
        f"kernels: {cpu.status()}"
    )
    print(
        f"{'tokens':>7} {'kernel ms':>10} {'ref ms':>8} {'ref/kern':>9} {'GFLOP/s':>8} {'of mm':>6}"
    )
    gen = torch.Generator().manual_seed(0)
    for new in args.tokens:
        total = args.cached + new
        blocks = -(-total // args.block_size)
        pool = blocks * 4
        cache = torch.randn(
            1, pool, 2, args.block_size, args.kv_heads, args.head_dim, generator=gen
        ).to(dtype)
        tables = [torch.randperm(pool, generator=gen)[:blocks]]
        q = torch.randn(new, args.heads, args.head_dim, generator=gen).to(dtype)
        call = (q, cache, 0, tables, [0, new], [0, total], args.head_dim**-0.5)
        kernel_s = per_call(lambda call=call: cpu.paged_prefill_attention(*call), args.calls)
        ref_s = per_call(lambda call=call: reference(*call), args.calls)
        # Causal over the new rows: each attends to the cached keys and to itself and earlier.
        pairs = new * args.cached + new * (new + 1) / 2
        flops = 4 * pairs * args.heads * args.head_dim
        rate = flops / kernel_s
        print(
            f"{new:>7} {kernel_s * 1e3:>10.2f} {ref_s * 1e3:>8.2f} {ref_s / kernel_s:>9.2f} "
            f"{rate / 1e9:>8.1f} {rate / rates.matmul_flops:>6.2f}"
        )


if __name__ == "__main__":
    main()
