"""The engine's decode step with a Python thread beside it on another core, as the response
sender runs beside the engine thread in a stub.

The engine steps ``--batch`` greedy requests on one thread pinned to ``--engine-core``; after
each step a second thread, pinned to ``--other-core``, runs ``--work-us`` microseconds of plain
Python (allocations, as building a response does) per output. Both hold the GIL for their
Python; torch releases it inside its ops. Prints the step's median wall and CPU time per amount
of work, so the cost of a microsecond of the sender's Python to the engine can be read off.

Run: python scripts/bench_step_beside_python.py --model CKPT --dtype float32 --work-us 0 100 250
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import threading
import time

import numpy as np
import torch

from splitserve import SamplingParams
from splitserve.engine.build import build_components, scheduler_limits
from splitserve.engine.engine import Engine
from splitserve.engine_config import EngineConfig


def python_work(items: queue.SimpleQueue[float], core: int) -> None:
    """For each item, that many seconds of thread CPU time spent in Python allocations."""
    os.sched_setaffinity(0, {core})
    while True:
        until = time.thread_time() + items.get()
        while time.thread_time() < until:
            np.array([b"text"], dtype=np.object_)
            [str(i) for i in range(16)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--work-us", type=float, nargs="+", default=[0.0, 100.0, 250.0])
    ap.add_argument("--engine-core", type=int, default=1)
    ap.add_argument("--other-core", type=int, default=0)
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.engine_core})
    torch.set_num_threads(1)
    cfg = EngineConfig(
        model=args.model, dtype=args.dtype, max_model_len=2048, kv_cache_bytes=1 << 29
    )
    parts = build_components(cfg)
    items: queue.SimpleQueue[float] = queue.SimpleQueue()
    threading.Thread(target=python_work, args=(items, args.other_core), daemon=True).start()
    params = SamplingParams(max_tokens=10**6, ignore_eos=True, temperature=0.0)
    prompt = [5 + i % 100 for i in range(args.prompt)]
    for work_us in args.work_us:
        engine = Engine(parts.model, parts.new_pool(), parts.tokenizer, scheduler_limits(cfg), 2048)
        for i in range(args.batch):
            engine.add_request(str(i), prompt, params)
        engine.step()
        walls, cpus = [], []
        for _ in range(args.steps):
            wall, cpu = time.perf_counter(), time.thread_time()
            outputs = engine.step()
            walls.append(time.perf_counter() - wall)
            cpus.append(time.thread_time() - cpu)
            for _ in outputs:
                items.put(work_us * 1e-6)
        print(
            f"batch {args.batch}, {work_us:.0f} us of Python per output beside it: step "
            f"{statistics.median(walls) * 1e3:.2f} ms, engine thread CPU "
            f"{statistics.median(cpus) * 1e3:.2f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
