"""Decode at light load: the default layout's ``llm`` against ``llm_colocated`` on small
checkpoints built the way a user outside the project builds them (transformers' own random
initialization, float32, a BPE ``tokenizer.json``), as issue 28 reported them.

Per row it serves the checkpoint with ``splitserve serve`` (layout ``both``, default flags plus
the row's), then measures both models two ways:

- the issue's run: ``splitserve bench --workload fixed --input-len 64 --output-len 32 --arrival
  poisson --rate 2 --num-requests 24``, one target after the other;
- turns: one to three requests at a time (64 prompt and 128 output tokens each), the two models
  alternating on each group (the regression test's measurement,
  ``tests/integration/test_light_load.py``).

and reads ``llm``'s engine counters over the issue's run (steps, busy seconds, borrowed and
withheld steps). ``--client`` places this script's client (the bench's process and the turns):
on the server's own cores as the regression test does, on the cores left to decode, or wherever
the kernel puts it. Prints a markdown table; writes ``out/light_load/light_load.json``.

Run: python scripts/bench_light_load.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_common import counters, loopback

from splitserve.deploy.serve import start_server
from splitserve.testing.checkpoints import write_tokenizer
from splitserve_tools.bench.prompts import exact_prompts, load_bench_tokenizer
from splitserve_tools.bench.serial import client_on, groups, median_tpot, take_turns
from splitserve_tools.bench.target import TritonTarget

CLI = (sys.executable, "-m", "splitserve_tools.cli")
OUT = Path(__file__).resolve().parents[1] / "out" / "light_load"
IN_FLIGHT = (1, 2, 3)
OUTPUT_TOKENS = 128

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2": dict(
        arch="qwen2",
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
    ),
    "llama32": dict(
        arch="llama",
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    ),
}
ROWS: list[tuple[str, str, list[str]]] = [
    ("Qwen2-style", "qwen2", []),
    ("Llama-3.2-style", "llama32", []),
    ("Llama-3.2-style, `--no-lend-prefill-cores`", "llama32", ["--no-lend-prefill-cores"]),
    ("Qwen2-style, `--dtype bfloat16`", "qwen2", ["--dtype", "bfloat16"]),
]


def hf_checkpoint(shape: str, out: Path) -> Path:
    """A float32 checkpoint with transformers' own random weights and tied embeddings."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if (out / "config.json").is_file():
        return out
    fields = dict(SHAPES[shape])
    arch = fields.pop("arch")
    config_cls, model_cls = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
    }[arch]
    config = config_cls(
        vocab_size=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        max_position_embeddings=2048,
        **fields,
    )
    torch.manual_seed(0)
    model_cls(config).float().save_pretrained(out)
    write_tokenizer(out, "bpe", config.vocab_size)
    return out


async def turns(url: str, model: str, prompts: int) -> dict[str, float]:
    tokenizer = load_bench_tokenizer(model)
    texts = exact_prompts(tokenizer, prompts + 3, 64)
    targets = [TritonTarget(url, "llm"), TritonTarget(url, "llm_colocated")]
    try:
        await take_turns(targets, groups(texts[:3], IN_FLIGHT), OUTPUT_TOKENS)
        records = await take_turns(targets, groups(texts[3:], IN_FLIGHT), OUTPUT_TOKENS)
    finally:
        for target in targets:
            await target.close()
    return {name: median_tpot(rs) for name, rs in records.items()}


def measure(model: Path, flags: list[str], args: argparse.Namespace, out: Path) -> dict:
    engine = {"max_model_len": "512"}
    if "--dtype" in flags:
        engine["dtype"] = flags[flags.index("--dtype") + 1]
    lend = False if "--no-lend-prefill-cores" in flags else None
    opts = loopback(str(model), "both", args.base_port, engine, lend_prefill_cores=lend)
    server = start_server(opts)
    try:
        # The bench's process is made by a pinned thread, so it starts on the client's cores.
        with client_on(client_cores(args.client, server.server_cores)):
            before = counters(server.metrics_url)
            bench = [
                *(*CLI, "bench", "--url", server.grpc_url, "--target", "llm"),
                *("--target", "llm_colocated", "--workload", "fixed", "--tokenizer", str(model)),
                *("--input-len", "64", "--output-len", "32", "--arrival", "poisson"),
                *("--rate", str(args.rate), "--num-requests", str(args.num_requests)),
                *("--json", str(out), "--no-progress"),
            ]
            subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
            time.sleep(0.5)  # the instances publish their counters every 0.1 s
            after = counters(server.metrics_url)
            turn = asyncio.run(turns(server.grpc_url, str(model), args.prompts))
    finally:
        server.stop()
    report = json.loads(out.read_text())
    tpot = {s["target"]: s["tpot_p50"] for s in report["summary"]}
    got = {name: v - before.get((m, name), 0.0) for (m, name), v in after.items() if m == "llm"}
    return {"bench_tpot_p50": tpot, "turns_tpot_p50": turn, "llm_engine": got}


def client_cores(where: str, server: set[int] | None) -> set[int] | None:
    """The cores for ``--client`` (None: anywhere)."""
    if where == "anywhere" or server is None:
        return None
    return server if where == "server" else os.sched_getaffinity(0) - server


def row_line(label: str, r: dict) -> str:
    bench, turn, eng = r["bench_tpot_p50"], r["turns_tpot_p50"], r["llm_engine"]
    steps = eng.get("engine_steps_total", 0.0)
    busy = eng.get("engine_busy_seconds_total", 0.0)
    return (
        f"| {label} | {bench['llm'] * 1e3:.1f} ms | {bench['llm_colocated'] * 1e3:.1f} ms | "
        f"{bench['llm'] / bench['llm_colocated']:.2f} | {turn['llm'] / turn['llm_colocated']:.2f} "
        f"| {steps:.0f} steps, {busy:.2f} s ({1e3 * busy / max(steps, 1):.1f} ms/step; "
        f"{eng.get('engine_borrowed_steps_total', 0):.0f} borrowed, "
        f"{eng.get('engine_borrow_withheld_steps_total', 0):.0f} withheld) |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--prompts", type=int, default=24, help="prompts of the turns measurement")
    ap.add_argument("--base-port", type=int, default=18800)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--client", choices=["server", "decode", "anywhere"], default="server")
    ap.add_argument("--rows", type=int, nargs="+", help="row numbers to run (0-based; all)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    lines = [
        "| checkpoint | `llm` TPOT p50 | `llm_colocated` TPOT p50 | ratio | ratio, turns | "
        "`llm` engine over the bench run |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for i, (label, shape, flags) in enumerate(ROWS):
        if args.rows is not None and i not in args.rows:
            continue
        model = hf_checkpoint(shape, args.out / f"ckpt-{shape}")
        results[label] = measure(model, flags, args, args.out / f"bench-{i}.json")
        lines.append(row_line(label, results[label]))
        print(lines[-1], flush=True)
    print("\n".join(lines))
    (args.out / "light_load.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out / 'light_load.json'}")


if __name__ == "__main__":
    main()
