"""TTFT and TPOT of `llm` (disaggregated) vs `llm_colocated` vs the offline engine, in one run.

Also the Triton pipeline's added time per token (llm vs the offline engine on the same one
core) and the KV handoff's speed vs a plain memcpy of the same bytes. Waves of `concurrency`
simultaneous streams; every number is the median over requests.
Run: python scripts/bench_pipeline.py --model tiny --model 100m
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import tritonclient.grpc.aio as grpcaio
from bench_common import checkpoint, exact_prompts, loopback, tokenizer_for
from tqdm import tqdm

from splitserve import SamplingParams
from splitserve.deploy.serve import start_server
from splitserve.engine.build import build_components, scheduler_limits
from splitserve.engine.engine import Engine
from splitserve.engine_config import EngineConfig
from splitserve.kv.layout import KVLayout
from splitserve_client.generate import GenerateArgs
from splitserve_client.stream import RequestRecord, stream_generate
from splitserve_tools.planner.handoff_timing import bench_handoff


def median(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def offline(
    model: str, prompts: list[str], args: argparse.Namespace, threads: int
) -> tuple[float, float]:
    """Median TTFT and TPOT of the in-process engine, same waves as the server runs."""
    torch.set_num_threads(threads)
    cfg = EngineConfig(model=model, max_model_len=args.max_model_len, dtype=args.dtype)
    parts = build_components(cfg)
    engine = Engine(
        parts.model, parts.new_pool(), parts.tokenizer, scheduler_limits(cfg), parts.max_model_len
    )
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    engine.add_request("warmup", parts.tokenizer.encode(prompts[0]), params)
    while engine.has_unfinished():
        engine.step()
    ttft, tpot = [], []
    for wave in range(0, len(prompts), args.concurrency):
        start = time.perf_counter()
        times: dict[str, list[float]] = {}
        for i, p in enumerate(prompts[wave : wave + args.concurrency]):
            engine.add_request(str(wave + i), parts.tokenizer.encode(p), params)
            times[str(wave + i)] = []
        while engine.has_unfinished():
            outs = engine.step()
            now = time.perf_counter()
            for o in outs:
                times[o.request_id].append(now)
        for t in times.values():
            ttft.append(t[0] - start)
            tpot.append((t[-1] - t[0]) / (len(t) - 1))
    torch.set_num_threads(2)
    return median(ttft), median(tpot)


async def served(
    url: str, target: str, prompts: list[str], args: argparse.Namespace
) -> list[RequestRecord]:
    client = grpcaio.InferenceServerClient(url)
    records: list[RequestRecord] = []
    try:
        for wave in range(0, len(prompts), args.concurrency):
            batch = prompts[wave : wave + args.concurrency]
            records += await asyncio.gather(
                *(
                    stream_generate(
                        client, GenerateArgs(p, url, target, True, args.output_len, ignore_eos=True)
                    )
                    for p in batch
                )
            )
    finally:
        await client.close()
    errors = [r.error for r in records if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    return records


def handoff(model: str, prompt_len: int) -> dict[str, float]:
    parts = build_components(EngineConfig(model=model))
    cfg = parts.model.cfg
    layout = KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, "float32")
    return bench_handoff(layout.blocks_for(prompt_len), layout)


def bench_model(name: str, args: argparse.Namespace) -> list[dict[str, object]]:
    model = checkpoint(name)
    rows: list[dict[str, object]] = []
    n = args.waves * max(args.concurrencies)
    prompts = exact_prompts(tokenizer_for(model), n, args.prompt_len)
    settings = {"max_model_len": str(args.max_model_len), "dtype": args.dtype}
    opts = loopback(model, "both", args.base_port, settings)
    server = start_server(opts)
    try:
        for c in tqdm(args.concurrencies, desc=f"{name} served"):
            args.concurrency = c
            batch = prompts[: args.waves * c]
            asyncio.run(served(server.grpc_url, "llm", batch[:c], args))
            for target in ("llm", "llm_colocated"):
                recs = asyncio.run(served(server.grpc_url, target, batch, args))
                rows.append(
                    {
                        "model": name,
                        "target": target,
                        "concurrency": c,
                        "ttft_ms": 1e3 * median([r.ttft for r in recs]),
                        "tpot_ms": 1e3 * median([r.tpot for r in recs]),
                    }
                )
    finally:
        server.stop()
    for c in tqdm(args.concurrencies, desc=f"{name} offline"):
        args.concurrency = c
        for threads, label in ((1, "offline (1 core)"), (2, "offline (2 cores)")):
            ttft, tpot = offline(model, prompts[: args.waves * c], args, threads)
            rows.append(
                {
                    "model": name,
                    "target": label,
                    "concurrency": c,
                    "ttft_ms": 1e3 * ttft,
                    "tpot_ms": 1e3 * tpot,
                }
            )
    rows.append({"model": name, "handoff": handoff(model, args.prompt_len)})
    return rows


def report(rows: list[dict[str, object]]) -> None:
    print(f"\n{'model':<8}{'target':<20}{'conc':>5}{'TTFT ms':>10}{'TPOT ms':>10}")
    for r in rows:
        if "target" in r:
            print(
                f"{r['model']:<8}{r['target']:<20}{r['concurrency']:>5}{r['ttft_ms']:>10.1f}{r['tpot_ms']:>10.2f}"
            )
    by = {(r["model"], r["target"], r["concurrency"]): r for r in rows if "target" in r}
    print(
        "\nServed TPOT gap: llm TPOT ÷ the offline engine's at the same concurrency (batch) and "
        "context, on 1 core (decode's own) and on 2 (decode with the prefill core it borrows)"
    )
    print(f"{'model':<8}{'conc':>5}{'llm ms':>10}{'1 core':>10}{'2 cores':>10}{'÷1':>7}{'÷2':>7}")
    for (model, target, c), r in by.items():
        if target == "llm":
            one = by[(model, "offline (1 core)", c)]["tpot_ms"]
            two = by[(model, "offline (2 cores)", c)]["tpot_ms"]
            served = r["tpot_ms"]
            print(
                f"{model:<8}{c:>5}{served:>10.2f}{one:>10.2f}{two:>10.2f}"
                f"{served / one:>7.2f}{served / two:>7.2f}"
            )
    print("\nKV handoff (shm transport) vs torch copy of the same bytes:")
    for r in rows:
        if "handoff" in r:
            h = r["handoff"]
            print(
                f"  {r['model']}: {h['bytes'] / 1e6:.2f} MB, fetch {1e3 * h['fetch_s']:.2f} ms "
                f"({h['fetch_gbps']:.1f} GB/s), copy {h['torch_copy_gbps']:.1f} GB/s, "
                f"ratio {h['fetch_vs_copy']:.2f}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", action="append", help="tiny or a preset (100m)")
    ap.add_argument("--concurrencies", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--base-port", type=int, default=18100)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    print(
        f"python {sys.version.split()[0]}, torch {torch.__version__}, "
        f"prefill on core 0, decode on core 1, colocated and offline (2 cores) on both"
    )
    rows = [r for m in args.model or ["tiny"] for r in bench_model(m, args)]
    report(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
