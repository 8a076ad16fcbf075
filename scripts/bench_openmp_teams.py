"""Decode step time by which thread built the engine and which one steps it.

A serving instance steps its engine on the loop's thread. If the model was built on another
thread that is still alive (Triton's, running ``initialize``), the process holds two OpenMP
teams and libgomp lets the loop's workers sleep between ops. Each case runs in a fresh process
pinned to the same cores, side by side:

- ``same``: built and stepped on the main thread (as the planner's profile times it);
- ``live``: built on the main thread, stepped on another (the server before the fix);
- ``exited``: built on a thread that has exited, stepped on another (``serving.threads``).

  python scripts/bench_openmp_teams.py --model 100m --cores 0,1 --batch 8 --context 256
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading

CASES = ("same", "live", "exited")


def child(args: argparse.Namespace) -> None:
    import torch

    from splitserve.engine.build import build_components
    from splitserve.engine_config import EngineConfig
    from splitserve.serving.threads import on_own_thread
    from splitserve_tools.planner.measure import time_decode

    cores = [int(c) for c in args.cores.split(",")]
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    cfg = EngineConfig(
        model=args.model_dir, dtype=args.dtype, device="cpu", max_model_len=2048,
        max_num_batched_tokens=4096, max_num_seqs=max(64, args.batch),
    )  # fmt: skip
    parts = on_own_thread(lambda: build_components(cfg)) if args.case == "exited" else None
    parts = parts or build_components(cfg)
    seconds: list[float] = []

    def step() -> None:
        with torch.inference_mode():
            runs = (time_decode(parts, cfg, args.batch, args.context, 20, 1) for _ in range(3))
            seconds.append(min(runs))

    if args.case == "same":
        step()
    else:
        thread = threading.Thread(target=step)
        thread.start()
        thread.join()
    print(json.dumps({"case": args.case, "step_ms": seconds[0] * 1e3}))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="100m", help="'tiny', a preset (100m) or a checkpoint dir")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cores", default="0,1")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        child(args)
        return
    from bench_common import checkpoint

    model_dir = (
        args.model if args.model == "tiny" or os.path.isdir(args.model) else checkpoint(args.model)
    )
    times = {}
    for case in CASES:
        cmd = [
            sys.executable, __file__, "--case", case, "--model-dir", model_dir,
            "--dtype", args.dtype, "--cores", args.cores,
            "--batch", str(args.batch), "--context", str(args.context),
        ]  # fmt: skip
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        times[case] = json.loads(out.strip().splitlines()[-1])["step_ms"]
        print(f"{case:>7}: {times[case]:6.2f} ms per decode step")
    print(f"live / same {times['live'] / times['same']:.2f}x, "
          f"exited / same {times['exited'] / times['same']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
