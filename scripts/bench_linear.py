"""One linear layer with half-precision weights, one thread: the rate of each matmul path.

Times ``splitserve_kernels.cpu.widened_linear`` (panels), oneDNN's bf16 matmul and MKL's float32
matmul of the same weights on the 100m model's layer shapes, for a few row counts. Each call
reads a different copy of the weights, and the copies together are larger than the last-level
cache, so that a row count a decode step would use reads its weights from memory as it would
in a model. Prints GFLOP/s and GB/s of weights (the half-precision bytes for the widened and
oneDNN paths, float32's for MKL), best of ``--repeats``. For an A/B of two checkouts, run it
alternately with ``PYTHONPATH=<checkout>/backends:<checkout>/kernels`` set and unset.

Run: taskset -c 1 python scripts/bench_linear.py --rows 1 4 8 16 64
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from splitserve.model.linear import Packed, linear, pack

SHAPES = {"qkv": (1280, 768), "gate_up": (4096, 768), "down": (768, 2048), "lm_head": (32000, 768)}
"""(out, in) of the 100m checkpoint's layers."""
WEIGHT_BYTES = 256 << 20
"""Bytes of weight copies cycled through per shape: past this machine's last-level cache."""


PATHS = {"widened": "widened", "oneDNN bf16": "onednn", "MKL float32": None}
"""Column -> ``SPLITSERVE_HALF_MATMUL`` for the bf16 weights (None: the weights in float32)."""


def packed_copies(half: list[torch.Tensor], path: str | None) -> list[tuple[torch.Tensor, Packed]]:
    """Each weight with its packed form for ``path``, as the model packs it."""
    if path is not None:
        os.environ["SPLITSERVE_HALF_MATMUL"] = path
    out = []
    for w in half:
        weight = w if path is not None else w.float()
        packed = pack(weight)
        assert packed is not None, f"{path}: no packed form on this CPU"
        out.append((weight, packed))
    return out


def best_seconds(x: torch.Tensor, copies: list[tuple[torch.Tensor, Packed]], repeats: int) -> float:
    """Best over ``repeats`` of the mean time of one call, each call on the next copy."""
    linear(x, copies[0][0], packed=copies[0][1])
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for weight, packed in copies:
            linear(x, weight, packed=packed)
        best = min(best, (time.perf_counter() - start) / len(copies))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"{'shape':8s} {'rows':>5s}  " + "  ".join(f"{c:>22s}" for c in PATHS))
    for name in args.shapes:
        n, k = SHAPES[name]
        half = [torch.randn(n, k).bfloat16() for _ in range(max(2, WEIGHT_BYTES // (n * k * 2)))]
        paths = {column: packed_copies(half, path) for column, path in PATHS.items()}
        for rows in args.rows:
            x = torch.randn(rows, k).bfloat16()
            cells = []
            for copies in paths.values():
                xc = x.to(copies[0][0].dtype)
                s = best_seconds(xc, copies, args.repeats)
                read = n * k * copies[0][0].element_size()
                cells.append(
                    f"{2 * rows * n * k / s / 1e9:7.1f} GFLOP/s {read / s / 1e9:5.1f} GB/s"
                )
            print(f"{name:8s} {rows:5d}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
