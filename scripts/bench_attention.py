"""CPU decode attention: the C++ kernel vs the pure-torch reference vs the read bandwidth limit.

Decode attention reads every cached key and value of the batch once per layer, so its limit is
the rate at which this process's threads can stream memory. The script measures that rate
(a large ``sum`` with the same thread count), then times one layer of decode attention for a
batch of sequences whose blocks are scattered over a KV pool of a realistic size (layer-major,
as ``splitserve.kv`` lays it out), with the kernel and with the reference, side by side.
``--contiguous`` gives each sequence one run of adjacent blocks instead, ``--run-blocks N`` runs
of ``N`` adjacent blocks at random places. Shapes default to the ``100m`` preset (12 heads, 4 KV
heads, head dim 64).

Run: python scripts/bench_attention.py --dtype bfloat16 --threads 1 --context 300 --context 1000
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from splitserve_kernels import cpu
from splitserve_kernels.reference.attention import paged_decode_attention as reference
from splitserve_tools.planner.measure import measure_rates


def per_call(fn: Callable[[int], object], calls: int) -> float:
    fn(0)
    t0 = time.perf_counter()
    for i in range(calls):
        fn(i)
    return (time.perf_counter() - t0) / calls


def tables_kind(args: argparse.Namespace) -> str:
    if args.contiguous:
        return "contiguous"
    return "random" if args.run_blocks == 1 else f"in random runs of {args.run_blocks}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, action="append", help="repeatable (default 300, 1000)")
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--pool-gib", type=float, default=2.0, help="KV pool the blocks are spread over"
    )
    ap.add_argument("--calls", type=int, default=24)
    ap.add_argument(
        "--contiguous", action="store_true", help="adjacent block ids per sequence (not random)"
    )
    ap.add_argument(
        "--run-blocks",
        type=int,
        default=1,
        help="random tables made of runs of this many adjacent block ids (default 1: scattered)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if cpu.extension() is None:
        raise SystemExit("the CPU kernel did not build; see the warning above")
    dtype = getattr(torch, args.dtype)
    slot_shape = (2, args.block_size, args.kv_heads, args.head_dim)
    block_bytes = args.layers * torch.Size(slot_shape).numel() * dtype.itemsize
    num_blocks = int(args.pool_gib * (1 << 30) // block_bytes)
    pool = torch.empty((args.layers, num_blocks, *slot_shape), dtype=dtype)
    pool.uniform_(-1, 1)
    bandwidth = measure_rates("cpu", args.dtype).read_bytes_per_s
    print(
        f"{args.dtype}, {args.threads} thread(s), batch {args.batch}, pool {num_blocks} blocks "
        f"({args.pool_gib:g} GiB, block tables {tables_kind(args)}); "
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s"
    )
    head = ("context", "kernel ms", "GB/s", "of limit", "reference ms", "ratio")
    print("{:>8}{:>11}{:>7}{:>10}{:>14}{:>8}".format(*head))
    gen = torch.Generator().manual_seed(0)
    scale = args.head_dim**-0.5
    for context in args.context or [300, 1000]:
        width = -(-context // args.block_size)
        if args.contiguous:
            tables = torch.arange(args.batch * width).view(args.batch, width)
        else:
            run = args.run_blocks
            runs = -(-args.batch * width // run)
            starts = torch.randperm(num_blocks // run, generator=gen)[:runs]
            ids = (starts[:, None] * run + torch.arange(run)).flatten()
            tables = ids[: args.batch * width].view(args.batch, width)
        lens = torch.full((args.batch,), context)
        q = torch.randn(args.batch, args.heads, args.head_dim, generator=gen).to(dtype)
        kv_bytes = args.batch * context * 2 * args.kv_heads * args.head_dim * dtype.itemsize

        def kernel(i: int, q=q, tables=tables, lens=lens) -> object:
            return cpu.paged_decode_attention(q, pool, i % args.layers, tables, lens, scale)

        def ref(i: int, q=q, tables=tables, lens=lens) -> object:
            return reference(q, pool, i % args.layers, tables, lens, scale)

        got, want = kernel(0), ref(0)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        t_kernel = per_call(kernel, args.calls)
        t_ref = per_call(ref, max(2, args.calls // 8))
        rate = kv_bytes / t_kernel
        print(
            f"{context:>8}{t_kernel * 1e3:>11.2f}{rate / 1e9:>7.1f}{rate / bandwidth:>10.0%}"
            f"{t_ref * 1e3:>14.2f}{t_ref / t_kernel:>7.1f}x"
        )


if __name__ == "__main__":
    main()
