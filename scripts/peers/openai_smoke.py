"""Send N concurrent greedy completions to an OpenAI-compatible server; print TTFT/TPOT.

    .venv/bin/python scripts/peers/openai_smoke.py http://127.0.0.1:8765/v1 ckpt-100m \
        --tokenizer .cache/ckpt-100m --concurrency 4 --input-len 256 --output-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import exact_prompts, tokenizer_for

from splitserve_tools.bench.openai_target import OpenAITarget


async def run(args: argparse.Namespace) -> int:
    prompts = exact_prompts(tokenizer_for(args.tokenizer), args.concurrency, args.input_len)
    target = OpenAITarget(args.base_url, args.model)
    try:
        await target.generate(prompts[0], 4)  # warm-up
        t0 = time.perf_counter()
        records = await asyncio.gather(*(target.generate(p, args.output_len) for p in prompts))
        wall = time.perf_counter() - t0
    finally:
        await target.close()
    bad = 0
    for i, r in enumerate(records):
        print(
            f"req {i}: ttft {r.ttft * 1e3:7.1f} ms  tpot {r.tpot * 1e3:6.2f} ms  "
            f"chunks {len(r.token_times)}  tokens {r.output_tokens}  "
            f"finish {r.finish_reason!r}  error {r.error}"
        )
        bad += r.error is not None or r.output_tokens != args.output_len
    ok = [r for r in records if r.error is None]
    if ok:
        ttft = statistics.median(r.ttft for r in ok) * 1e3
        tpot = statistics.median(r.tpot for r in ok) * 1e3
        print(
            f"{len(ok)}/{len(records)} ok; TTFT median {ttft:.1f} ms, TPOT median {tpot:.2f} ms, "
            f"{sum(r.output_tokens for r in ok) / wall:.1f} output tok/s over {wall:.2f} s"
        )
    return 1 if bad else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("base_url")
    p.add_argument("model")
    p.add_argument("--tokenizer", required=True, help="checkpoint dir whose tokenizer to use")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    raise SystemExit(asyncio.run(run(p.parse_args())))


if __name__ == "__main__":
    main()
