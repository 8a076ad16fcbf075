"""How steady this machine's speed is: the same small piece of work, timed over and over on
each core at once while nothing else runs.

Two kinds of work per sample: a pure-Python loop (what the serving path's Python does) and a
small float32 matmul on one thread (what a decode step does). Each sample's time over the
fastest of its kind and core is its slowdown: 1.0 where the core ran at full speed. On a
virtual machine whose host shares its cores (SMT siblings, other guests), slowdowns well above
1 come and go within seconds, and any two runs taken one after the other differ by them: such
a machine needs A/Bs interleaved within seconds, and a table's cells carry that spread. The
correlation of the two cores' slowdowns says whether the host slows both at once.

Run: python scripts/bench_steadiness.py --seconds 60 --plot out/steadiness.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

KINDS = ("python", "matmul")


def python_work() -> None:
    total = 0
    for i in range(100_000):
        total += i * i


def worker(core: int, seconds: float, interval: float) -> None:
    """Pinned to ``core``: one JSON line per sample, ``[t, python_s, matmul_s]``."""
    import torch

    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    x, w = torch.randn(64, 512), torch.randn(2048, 512)

    def matmul_work() -> None:
        for _ in range(20):
            torch.nn.functional.linear(x, w)

    matmul_work()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sample = [time.monotonic()]
        for work in (python_work, matmul_work):
            start = time.perf_counter()
            work()
            sample.append(time.perf_counter() - start)
        print(json.dumps(sample), flush=True)
        time.sleep(interval)


def correlation(x: list[float], y: list[float]) -> float:
    mx, my = statistics.fmean(x), statistics.fmean(y)
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
    sx = sum((a - mx) ** 2 for a in x) ** 0.5
    sy = sum((b - my) ** 2 for b in y) ** 0.5
    return sxy / (sx * sy) if sx and sy else float("nan")


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(samples: dict[int, list[list[float]]]) -> dict[str, object]:
    """Per core and kind: the fastest time and the slowdown quantiles; the cores' correlation."""
    out: dict[str, object] = {}
    print(f"{'core':>4} {'work':<7}{'fastest ms':>11}{'p50':>7}{'p90':>7}{'max':>7}{'≤1.1':>7}")
    slow: dict[tuple[int, str], list[float]] = {}
    for core, rows in samples.items():
        for k, kind in enumerate(KINDS, start=1):
            times = [r[k] for r in rows]
            fastest = min(times)
            ratios = [t / fastest for t in times]
            slow[(core, kind)] = ratios
            steady = sum(r <= 1.1 for r in ratios) / len(ratios)
            row = {
                "fastest_ms": 1e3 * fastest,
                "p50": quantile(ratios, 0.5),
                "p90": quantile(ratios, 0.9),
                "max": max(ratios),
                "within_10pct": steady,
            }
            out[f"core{core}_{kind}"] = row
            print(
                f"{core:>4} {kind:<7}{row['fastest_ms']:>11.2f}{row['p50']:>7.2f}"
                f"{row['p90']:>7.2f}{row['max']:>7.2f}{steady:>7.0%}"
            )
    cores = sorted(samples)
    if len(cores) == 2:
        n = min(len(samples[c]) for c in cores)
        for kind in KINDS:
            a, b = (slow[(c, kind)][:n] for c in cores)
            r = out[f"cores_correlation_{kind}"] = correlation(a, b)
            print(f"slowdown of core {cores[0]} vs core {cores[1]}, {kind}: r = {r:.2f}")
    for core in cores:
        r = correlation(slow[(core, "python")], slow[(core, "matmul")])
        out[f"core{core}_python_vs_matmul"] = r
        print(f"core {core}, python vs matmul slowdown: r = {r:.2f}")
    return out


def plot(samples: dict[int, list[list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(KINDS), 1, sharex=True, figsize=(9, 5))
    t0 = min(rows[0][0] for rows in samples.values())
    for k, (ax, kind) in enumerate(zip(axes, KINDS, strict=True), start=1):
        for core, rows in sorted(samples.items()):
            fastest = min(r[k] for r in rows)
            ax.plot([r[0] - t0 for r in rows], [r[k] / fastest for r in rows], label=f"core {core}")
        ax.set_ylabel(f"{kind}: time ÷ fastest")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.legend(loc="upper right")
    axes[-1].set_xlabel("seconds")
    fig.suptitle("The same work, timed over and over on an otherwise idle machine")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--interval", type=float, default=0.2, help="sleep between samples (s)")
    ap.add_argument(
        "--cores", default="", help="comma-separated; default: all this process may use"
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker, args.seconds, args.interval)
        return
    cores = [int(c) for c in args.cores.split(",") if c] or sorted(os.sched_getaffinity(0))
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if "model name" in line), "?")
    print(f"{model}; cores {cores}; {args.seconds:.0f} s, a sample every ~{args.interval} s")
    base = [sys.executable, __file__, "--seconds", str(args.seconds), "--interval"]
    procs = {
        c: subprocess.Popen(
            [*base, str(args.interval), "--worker", str(c)], stdout=subprocess.PIPE, text=True
        )
        for c in cores
    }
    samples = {
        c: [json.loads(line) for line in p.communicate()[0].splitlines()] for c, p in procs.items()
    }
    if any(p.returncode for p in procs.values()) or not all(samples.values()):
        raise SystemExit("a worker failed")
    result = report(samples)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cpu": model, **result}, indent=2))
    if args.plot:
        plot(samples, args.plot)


if __name__ == "__main__":
    main()
