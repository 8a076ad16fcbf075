"""Where one decode step of the engine goes, in-process: kernels, matmuls and Python, per step.

The engine runs ``--batch`` greedy requests with ``--prompt`` token prompts on one thread, steps
past the prompt passes and ``--warmup`` decode steps (so that each sequence's later blocks are
handed out interleaved with the others', as in a server), then times ``--steps`` steps, and
once more under cProfile to split them by the builtin each spends its time in. The decode
attention's read rate is its KV bytes over its time. For an A/B of two checkouts, run it
alternately with ``PYTHONPATH=<checkout>/backends:<checkout>/kernels`` set and unset.

Run: taskset -c 1 python scripts/bench_decode_step.py --model .cache/ckpt-100m --batch 90
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from splitserve import SamplingParams
from splitserve.engine.build import build_components, scheduler_limits
from splitserve.engine.engine import Engine
from splitserve.engine_config import EngineConfig

SHOWN = 8
"""Builtins listed by time per step."""


def build(args: argparse.Namespace) -> Engine:
    cfg = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_cache_bytes=args.kv_cache_gib << 30,
        block_size=args.block_size,
        num_threads=args.threads,
    )
    parts = build_components(cfg)
    engine = Engine(
        parts.model, parts.new_pool(), parts.tokenizer, scheduler_limits(cfg), args.max_model_len
    )
    params = SamplingParams(max_tokens=args.max_model_len, ignore_eos=True, temperature=0.0)
    prompt = [5 + i % 100 for i in range(args.prompt)]
    for i in range(args.batch):
        engine.add_request(str(i), prompt, params)
    return engine


def kv_tokens(engine: Engine) -> int:
    return sum(state.req.num_computed for state in engine.states.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=90)
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=100, help="decode steps before timing")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-gib", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = build(args)
    while any(s.req.num_computed < args.prompt for s in engine.states.values()):
        engine.step()
    for _ in range(args.warmup):
        engine.step()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_s = (time.perf_counter() - start) / args.steps
    print(
        f"batch {args.batch}, context ~{args.prompt + args.warmup + args.steps // 2}, "
        f"{args.threads} thread(s): step {step_s * 1e3:.1f} ms, {args.batch / step_s:.0f} tokens/s"
    )
    before = kv_tokens(engine)
    profiler = cProfile.Profile()
    profiler.runcall(lambda: [engine.step() for _ in range(args.steps)])
    layout = engine.runner.pool.layout
    kv_bytes = (before + kv_tokens(engine)) / 2 * layout.block_bytes / layout.block_size
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    rows = sorted(
        ((tottime, name) for (_, _, name), (_, _, tottime, _, _) in stats.items()), reverse=True
    )
    print(f"under cProfile, per step ({kv_bytes / 1e6:.0f} MB of KV read by attention):")
    for tottime, name in rows[:SHOWN]:
        per_step = tottime / args.steps
        line = f"  {per_step * 1e3:7.2f} ms  {name}"
        if "paged_decode_attention" in name:
            line += f"  ({kv_bytes / per_step / 1e9:.1f} GB/s of KV)"
        print(line)


if __name__ == "__main__":
    main()
