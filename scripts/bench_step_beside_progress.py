"""The engine's decode step beside what drives a NIXL agent's transfers: nothing, a Python thread
that wakes every ``--poll-ms`` (as the transport's own progress loop did), or an idle agent
whose NIXL progress thread waits on UCX's event fd (``transport.nixl_parts.new_agent``).

One engine steps ``--batch`` greedy requests; the three cases take turns every ``--steps``
steps, ``--rounds`` times, so that they share the machine's state (a process's step time moves
by 20 % between starts on some parts). Prints each case's median and mean step and its ratio to
the step with nothing beside it.

Run: python scripts/bench_step_beside_progress.py --model .cache/ckpt-100m --batch 8
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import torch

from splitserve import SamplingParams
from splitserve.engine.build import build_components, scheduler_limits
from splitserve.engine.engine import Engine
from splitserve.engine_config import EngineConfig
from splitserve.transport.nixl_parts import new_agent

CASES = ("nothing", "python-poll", "nixl-thread")


class Poller:
    """A Python thread that wakes every ``period_s`` while ``on`` is set."""

    def __init__(self, period_s: float) -> None:
        self.on = threading.Event()
        self._period_s = period_s
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            self.on.wait()
            time.sleep(self._period_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--poll-ms", type=float, default=2.0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = EngineConfig(
        model=args.model, dtype=args.dtype, max_model_len=2048, kv_cache_bytes=1 << 30
    )
    parts = build_components(cfg)
    engine = Engine(parts.model, parts.new_pool(), parts.tokenizer, scheduler_limits(cfg), 2048)
    params = SamplingParams(max_tokens=10**6, ignore_eos=True, temperature=0.0)
    for i in range(args.batch):
        engine.add_request(str(i), [5 + (i + j) % 100 for j in range(args.prompt)], params)
    for _ in range(5):
        engine.step()
    poller = Poller(args.poll_ms * 1e-3)
    steps: dict[str, list[float]] = {case: [] for case in CASES}
    for n in range(args.rounds * len(CASES)):
        case = CASES[n % len(CASES)]
        agent: Any = new_agent(f"bench-{n}") if case == "nixl-thread" else None
        if case == "python-poll":
            poller.on.set()
        time.sleep(0.05)
        for _ in range(args.steps):
            started = time.perf_counter()
            engine.step()
            steps[case].append(time.perf_counter() - started)
        poller.on.clear()
        del agent
    base = statistics.mean(steps["nothing"])
    print(f"batch {args.batch}, {args.threads} threads, Python poll every {args.poll_ms:g} ms")
    for case, times in steps.items():
        print(
            f"{case:>12}: step median {statistics.median(times) * 1e3:6.2f} ms, mean "
            f"{statistics.mean(times) * 1e3:6.2f} ms = {statistics.mean(times) / base:.3f}x"
        )


if __name__ == "__main__":
    main()
