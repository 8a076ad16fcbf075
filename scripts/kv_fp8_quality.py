"""What FP8 transfer encoding (``--kv-transfer-dtype fp8``) does to a model's output.

Only the prompt's KV crosses the link, so only it is encoded: for each prompt, transformers
computes the prompt's KV (bfloat16), the KV is encoded and decoded in blocks of 16 tokens with a
scale per block and head exactly as the transport does (``splitserve_kernels``), and generation
continues from the exact and from the round-tripped cache. Reported per checkpoint:

- per-layer reconstruction error of K and V: ||decoded - exact|| / ||exact||;
- KL(exact || fp8) of the next-token distributions over ``--tokens`` steps, both caches fed the
  exact run's tokens (teacher forcing), and how often their top-1 choices agree;
- greedy agreement: the fp8 run generating freely, the fraction of its tokens equal to the exact
  run's and the step of the first difference.

Checkpoints: random 100m-shaped Llama (GQA 12/4 heads) and Qwen2 (q/k/v bias), each as written
and with "outlier" key channels (two dimensions per KV head scaled by ``--outlier``, as trained
models' keys have a few channels far larger than the rest, which is what per-head scaling
struggles with). Random weights are not trained ones: the numbers show how the encoding's error
propagates through these shapes, not how a trained model's quality moves.

Run: python scripts/kv_fp8_quality.py [--prompts 4] [--prompt-len 512] [--tokens 256]
                                      [--json out/kv_fp8_quality.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from bench_common import CACHE

import splitserve_kernels as kernels
from splitserve.testing.checkpoints import PRESETS, write_random_checkpoint

BLOCK = 16
FAMILIES = ("llama", "qwen2")


def checkpoint(arch: str) -> Path:
    out = CACHE / f"ckpt-100m-{arch}"
    if not (out / "config.json").is_file():
        write_random_checkpoint(out, arch=arch, **PRESETS["100m"], tokenizer="bpe")  # type: ignore[arg-type]
    return out


def add_outliers(model: Any, factor: float, seed: int = 0) -> None:
    """Scale two head dimensions of every KV head's keys (weight rows and bias) by ``factor``."""
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    with torch.no_grad():
        for layer in model.model.layers:
            k = layer.self_attn.k_proj
            for head in range(cfg.num_key_value_heads):
                dims = torch.randperm(head_dim, generator=gen)[:2] + head * head_dim
                k.weight[dims] *= factor
                if k.bias is not None:
                    k.bias[dims] *= factor


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """``[1, heads, T, dim]`` of one layer's K or V through the transport's fp8 blocks (a scale
    per 16 tokens and head) and back."""
    _, heads, tokens, dim = x.shape
    blocks = -(-tokens // BLOCK)
    padded = torch.zeros(blocks * BLOCK, heads, dim, dtype=x.dtype)
    padded[:tokens] = x[0].transpose(0, 1)
    # One pool layer with K in slot 0 (V's slot zero): [1, blocks, 2, BLOCK, heads, dim].
    pool = torch.zeros(1, blocks, 2, BLOCK, heads, dim, dtype=x.dtype)
    pool[0, :, 0] = padded.view(blocks, BLOCK, heads, dim)
    q = torch.empty(pool.shape, dtype=torch.uint8)
    scales = torch.empty(1, blocks, 2, heads)
    ids = torch.arange(blocks)
    kernels.fp8_encode_blocks(pool, ids, q, scales, ids)
    out = torch.empty_like(pool)
    kernels.fp8_decode_blocks(q, scales, ids, out, ids)
    return out[0, :, 0].reshape(blocks * BLOCK, heads, dim)[:tokens].transpose(0, 1)[None]


def scaled_e4m3(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """e4m3 with one scale per slice over ``dims`` (for the granularity comparison)."""
    f = x.float()
    amax = f.abs().amax(dim=dims, keepdim=True).clamp_min(1e-30)
    return ((f * (448.0 / amax)).to(torch.float8_e4m3fn).float() * (amax / 448.0)).to(x.dtype)


VARIANTS = {
    "tensor": lambda x: scaled_e4m3(x, (0, 1, 2, 3)),  # one scale per layer: vLLM's fp8 cache
    "block": round_trip,  # the transport's: per 16 tokens and head
    "token": lambda x: scaled_e4m3(x, (3,)),  # per token and head: 4 bytes per 64 values
}
NOISE_BF16 = 2.0**-9 / 3**0.5
"""Relative RMS of bfloat16's own rounding (uniform in half an ulp of 8 mantissa bits)."""


def rel_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.float() - exact.float()).norm() / exact.float().norm())


def noisy(x: torch.Tensor, rel: float, gen: torch.Generator) -> torch.Tensor:
    rms = x.float().pow(2).mean().sqrt()
    return (x.float() + torch.randn(x.shape, generator=gen) * rel * rms).to(x.dtype)


def transformed(cache: Any, fn: Any) -> Any:
    import copy

    out = copy.deepcopy(cache)
    for layer in out.layers:
        layer.keys, layer.values = fn(layer.keys), fn(layer.values)
    return out


def generate(model: Any, cache: Any, first: int, steps: int, forced: list[int] | None) -> Any:
    """Greedy steps from ``cache`` (``forced``: feed these tokens instead); tokens, log-probs."""
    token, tokens, logps = first, [], []
    with torch.no_grad():
        for i in range(steps):
            out = model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            logp = torch.log_softmax(out.logits[0, -1].float(), -1)
            logps.append(logp)
            choice = int(logp.argmax())
            tokens.append(choice)
            token = forced[i] if forced is not None else choice
    return tokens, logps


def one_prompt(model: Any, ids: list[int], steps: int) -> dict[str, Any]:
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
    first = int(out.logits[0, -1].argmax())  # prefill's token: computed before any transfer
    exact = out.past_key_values
    errors = {
        name: [
            (rel_error(fn(layer.keys), layer.keys), rel_error(fn(layer.values), layer.values))
            for layer in exact.layers
        ]
        for name, fn in VARIANTS.items()
    }
    fp8_rel = statistics.fmean(k for k, _ in errors["block"])
    gen = torch.Generator().manual_seed(2)
    caches = {
        "fp8": transformed(exact, round_trip),
        "noise_like_fp8": transformed(exact, lambda x: noisy(x, fp8_rel, gen)),
        "noise_bf16": transformed(exact, lambda x: noisy(x, NOISE_BF16, gen)),
    }
    free = transformed(exact, round_trip)
    exact_tokens, exact_logps = generate(model, exact, first, steps, None)
    row: dict[str, Any] = {"layer_errors": errors}
    for name, cache in caches.items():
        tokens, logps = generate(model, cache, first, steps, exact_tokens)
        kl = [float((p.exp() * (p - q)).sum()) for p, q in zip(exact_logps, logps, strict=True)]
        row[name] = {
            "kl_mean": statistics.fmean(kl),
            "kl_max": max(kl),
            "top1": statistics.fmean(a == b for a, b in zip(exact_tokens, tokens, strict=True)),
        }
    free_tokens, _ = generate(model, free, first, steps, None)
    same = [a == b for a, b in zip(exact_tokens, free_tokens, strict=True)]
    row["greedy_agreement"] = statistics.fmean(same)
    row["first_difference"] = same.index(False) if False in same else None
    return row


def summarize(arch: str, outlier: float | None, runs: list[dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {"arch": arch, "outliers": outlier}
    for name in VARIANTS:
        for i, kv in enumerate(("k", "v")):
            per_layer = [
                statistics.fmean(r["layer_errors"][name][layer][i] for r in runs)
                for layer in range(len(runs[0]["layer_errors"][name]))
            ]
            row[f"{kv}_error_{name}"] = per_layer
    for name in ("fp8", "noise_like_fp8", "noise_bf16"):
        row[name] = {
            "kl_mean": statistics.fmean(r[name]["kl_mean"] for r in runs),
            "kl_max": max(r[name]["kl_max"] for r in runs),
            "top1": statistics.fmean(r[name]["top1"] for r in runs),
        }
    row["greedy_agreement"] = statistics.fmean(r["greedy_agreement"] for r in runs)
    row["first_difference"] = [r["first_difference"] for r in runs]
    return row


def row_line(row: dict[str, Any]) -> str:
    errs = "  ".join(
        f"{kv.upper()} err {name} {statistics.fmean(row[f'{kv}_error_{name}']):.4f}"
        for kv in ("k", "v")
        for name in VARIANTS
    )
    kls = "  ".join(
        f"{name}: KL {row[name]['kl_mean']:.3g} (max {row[name]['kl_max']:.3g}) "
        f"top-1 {row[name]['top1']:.3f}"
        for name in ("fp8", "noise_like_fp8", "noise_bf16")
    )
    outliers = "none" if row["outliers"] is None else f"x{row['outliers']:g}"
    return (
        f"{row['arch']} outliers {outliers}\n  {errs}\n  {kls}\n  greedy agreement "
        f"{row['greedy_agreement']:.3f}, first difference at {row['first_difference']}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--outlier", type=float, default=8.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    results = []
    for arch in FAMILIES:
        for outliers in (False, True):
            model = AutoModelForCausalLM.from_pretrained(checkpoint(arch), dtype=torch.bfloat16)
            model.eval()
            if outliers:
                add_outliers(model, args.outlier)
            gen = torch.Generator().manual_seed(1)
            vocab = model.config.vocab_size
            runs = []
            for p in range(args.prompts):
                ids = torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()
                runs.append(one_prompt(model, ids, args.tokens))
                print(f"  {arch} outliers={outliers} prompt {p}/{args.prompts} done", flush=True)
            row = summarize(arch, args.outlier if outliers else None, runs)
            results.append(row)
            print(row_line(row), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
