"""Where prefill's time goes while it serves: its passes on the metrics port against the same
prompts computed offline on the same cores.

Serves ``--layout disagg`` on the default 1 + 1 split, drives ``llm`` at one open-loop rate
(``splitserve bench``, the workload's prompts), and reads the prefill and decode instances'
engine counters over the run: busy seconds (wall time of their passes) and the CPU seconds of
each engine's own thread in them. With the server stopped, it computes the very prompts the
bench sent, in passes of the served mean batch (Triton's dynamic batcher packs the prompts
queued at a pass's start), pinned to the prefill cores with as many threads. Per prompt:

- served wall - served CPU: the time prefill sat runnable while other threads held its cores
  (tritonserver, decode's helper threads and lent steps, the client);
- served CPU - offline: what the same passes cost more in the server on the CPU itself.

Run: python scripts/bench_interference.py --model 100m --rate 7 --num-requests 350
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from bench_common import checkpoint, counters, loopback
from tqdm import tqdm

from splitserve import SamplingParams
from splitserve.deploy.serve import start_server
from splitserve.engine.build import build_components
from splitserve.engine.prompt_pass import PrefillEngine
from splitserve.engine.request import Request
from splitserve.engine_config import EngineConfig
from splitserve.serving.affinity import parse_cores
from splitserve_tools.workload.lengths import workload_lengths

CLI = (sys.executable, "-m", "splitserve_tools.cli")
OUT = Path(__file__).resolve().parents[1] / "out" / "interference"


def served(args: argparse.Namespace, model: str, out: Path) -> dict[tuple[str, str], float]:
    """Counter increments of a bench run at ``args.rate`` against ``llm``."""
    engine = {"dtype": args.dtype, "max_model_len": str(args.max_model_len)}
    opts = loopback(
        model,
        "disagg",
        args.base_port,
        engine,
        prefill_cores=args.prefill_cores,
        decode_cores=args.decode_cores,
    )
    server = start_server(opts)
    try:
        before = counters(server.metrics_url)
        bench = [
            *(*CLI, "bench", "--url", server.grpc_url, "--target", "llm"),
            *("--workload", args.workload, "--tokenizer", model),
            *("--max-model-len", str(args.max_model_len), "--arrival", "poisson"),
            *("--rate", str(args.rate), "--num-requests", str(args.num_requests)),
            *("--ttft-slo", str(args.ttft_slo), "--tpot-slo", str(args.tpot_slo)),
            *("--seed", str(args.seed), "--json", str(out / "bench.json"), "--no-progress"),
        ]
        subprocess.run(bench, check=True)
        time.sleep(1.0)  # the instances publish their counters every 0.1 s
        after = counters(server.metrics_url)
    finally:
        server.stop()
    return {key: after[key] - before.get(key, 0.0) for key in after}


def offline_prefill_s(
    args: argparse.Namespace, model: str, lengths: list[int], batch: int
) -> float:
    """Seconds of prefill for ``lengths``, ``batch`` prompts a pass, on the prefill cores."""
    cores = parse_cores(args.prefill_cores)
    os.sched_setaffinity(0, cores)
    cfg = EngineConfig(
        model=model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        num_threads=len(cores),
        kv_cache_bytes=1 << 30,
    )
    parts = build_components(cfg)
    engine = PrefillEngine(parts.model, parts.new_pool(), parts.eos_ids, parts.max_model_len)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(args.seed)
    vocab = parts.model.cfg.vocab_size
    total = 0.0
    for first in tqdm(range(0, len(lengths), batch), desc="offline prefill"):
        reqs = [
            Request(str(first + i), torch.randint(3, vocab, (n,), generator=gen).tolist(), params)
            for i, n in enumerate(lengths[first : first + batch])
        ]
        start = time.perf_counter()
        engine.prefill(reqs)
        total += time.perf_counter() - start
        for req in reqs:
            engine.free(req)
    return total


def served_row(got: dict[tuple[str, str], float]) -> dict[str, float]:
    """Per prompt (prefill) and per step (decode): wall and CPU milliseconds of the run."""

    def ms(model: str, name: str, per: float) -> float:
        return 1e3 * got.get((model, f"engine_{name}_total"), 0.0) / per

    prompts = got.get(("prefill", "engine_sampled_tokens_total"), 0.0)
    steps = got.get(("llm", "engine_steps_total"), 0.0)
    return {
        "prompts": prompts,
        "prefill_passes": got.get(("prefill", "engine_steps_total"), 0.0),
        "prefill_wall_ms_per_prompt": ms("prefill", "busy_seconds", prompts),
        "prefill_cpu_ms_per_prompt": ms("prefill", "cpu_seconds", prompts),
        "decode_steps": steps,
        "decode_wall_ms_per_step": ms("llm", "busy_seconds", steps),
        "decode_cpu_ms_per_step": ms("llm", "cpu_seconds", steps),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="100m", help="'tiny' or a preset (e.g. 100m)")
    ap.add_argument("--workload", default="chatbot")
    ap.add_argument("--rate", type=float, default=7.0)
    ap.add_argument("--num-requests", type=int, default=350)
    ap.add_argument("--ttft-slo", type=float, default=3.0)
    ap.add_argument("--tpot-slo", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--prefill-cores", default="0")
    ap.add_argument("--decode-cores", default="1")
    ap.add_argument("--base-port", type=int, default=18700)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = checkpoint(args.model)
    row = served_row(served(args, model, args.out))
    pairs = workload_lengths(args.workload, args.num_requests, args.max_model_len, args.seed)
    lengths = [n for n, _ in pairs]
    passes = row["prefill_passes"]
    batch = max(1, round(row["prompts"] / passes)) if passes else 1
    off = 1e3 * offline_prefill_s(args, model, lengths, batch) / len(lengths)
    row["prefill_offline_ms_per_prompt"] = off
    wall, cpu = row["prefill_wall_ms_per_prompt"], row["prefill_cpu_ms_per_prompt"]
    print(
        f"prefill, {row['prompts']:.0f} prompts in {row['prefill_passes']:.0f} passes at "
        f"{args.rate:g} req/s: served {wall:.1f} ms a prompt ({cpu:.1f} of them on its CPU), "
        f"offline {off:.1f} ({batch} a pass)\n"
        f"  waiting for its cores: {(wall - cpu) / wall:.0%} of served time; "
        f"CPU cost over offline: {cpu / off - 1:+.0%}; served over offline: {wall / off:.2f}x\n"
        f"decode, {row['decode_steps']:.0f} steps: {row['decode_wall_ms_per_step']:.1f} ms a "
        f"step, {row['decode_cpu_ms_per_step']:.1f} of them on its CPU"
    )
    (args.out / "interference.json").write_text(json.dumps(row, indent=2) + "\n")
    print(f"wrote {args.out / 'interference.json'}")


if __name__ == "__main__":
    main()
