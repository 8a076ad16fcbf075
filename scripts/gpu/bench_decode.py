"""Time decode steps of the engine on CUDA against the HBM roofline; writes JSON (``--out``).

A step must read every weight once and the KV of every running sequence, so its floor is
``(weight bytes + KV bytes) / bandwidth``. Runs the Triton decode kernel and the torch
reference (``SPLITSERVE_KERNELS=reference``) on the same random ~1B-parameter checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

import splitserve_kernels
from splitserve.engine.build import build_components, scheduler_limits
from splitserve.engine.engine import Engine
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine_config import EngineConfig
from splitserve.testing.checkpoints import write_random_checkpoint

SHAPE = {
    "hidden_size": 2048,
    "num_layers": 16,
    "num_heads": 32,
    "num_kv_heads": 8,
    "intermediate_size": 8192,
    "vocab_size": 32768,
}


def run(ckpt: str, batch: int, prompt: int, steps: int, hbm_tbps: float) -> dict[str, float]:
    cfg = EngineConfig(
        model=ckpt, dtype="bfloat16", device="cuda", kv_cache_bytes=8 << 30, max_num_seqs=256
    )
    parts = build_components(cfg)
    engine = Engine(
        parts.model, parts.new_pool(), parts.tokenizer, scheduler_limits(cfg), parts.max_model_len
    )
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [1 + (i + j) % 1000 for j in range(prompt)], params)
    while sum(bool(r.output_ids) for r in engine.scheduler.running) < batch:
        engine.step()
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - start) / steps
    weight_bytes = sum(p.numel() * p.element_size() for p in parts.model.parameters())
    if parts.model.lm_head is parts.model.embed_tokens:
        weight_bytes += parts.model.lm_head.numel() * parts.model.lm_head.element_size()
    layout = parts.layout
    token_kv = layout.num_layers * 2 * layout.num_kv_heads * layout.head_dim * 2
    kv_bytes = batch * (prompt + 3 + steps / 2) * token_kv
    floor_s = (weight_bytes + kv_bytes) / (hbm_tbps * 1e12)
    return {
        "batch": batch,
        "prompt": prompt,
        "step_ms": step_s * 1e3,
        "roofline_ms": floor_s * 1e3,
        "fraction_of_roofline": floor_s / step_s,
        "tokens_per_s": batch / step_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--hbm-tbps", type=float, default=4.8)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(
            write_random_checkpoint(
                tmp, **SHAPE, dtype="bfloat16", tokenizer=None, max_position_embeddings=4096
            )
        )
        for kernels in ("triton", "reference"):
            if kernels == "reference":
                os.environ[splitserve_kernels.dispatch.FORCE_ENV] = "reference"
            splitserve_kernels.triton_available.cache_clear()
            for batch in map(int, args.batches.split(",")):
                row = {
                    "kernels": kernels,
                    **run(ckpt, batch, args.prompt, args.steps, args.hbm_tbps),
                }
                print(json.dumps(row), flush=True)
                results.append(row)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
