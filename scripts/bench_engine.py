"""Engine speed vs Hugging Face transformers on the same weights, and vs the machine's limits.

Decode tokens/s at several batch sizes and prefill tokens/s at long prompts, each as a fraction
of its physical limit. A decode step cannot take less than the larger of (weights + KV read) /
memory bandwidth and its FLOPs / matmul rate; prefill is bound by FLOPs / matmul rate. Both rates
are measured here first. Run: python scripts/bench_engine.py --model tiny --model DIR
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from splitserve import SamplingParams
from splitserve.engine.build import Components, build_components, scheduler_limits
from splitserve.engine.engine import Engine
from splitserve.engine_config import EngineConfig
from splitserve.model.export import to_hf_state_dict
from splitserve.model.llama import LlamaForCausalLM
from splitserve.model.tiny import TINY_HF_CONFIG
from splitserve_tools.planner.gpu_model import matmul_params
from splitserve_tools.planner.measure import measure_rates


@dataclass
class Row:
    model: str
    phase: str
    batch: int
    ours_tok_s: float
    hf_tok_s: float
    limit_tok_s: float

    @property
    def ratio(self) -> float:
        return self.ours_tok_s / self.hf_tok_s

    @property
    def fraction(self) -> float:
        return self.ours_tok_s / self.limit_tok_s


def memory_bandwidth(n_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s moved by a large tensor copy (read + write counted)."""
    src = torch.ones(n_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * n_bytes / best


def weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes a decode step reads: every matrix but the embedding table (one row per token)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.cfg.tie_word_embeddings:
        total -= model.embed_tokens.numel() * model.embed_tokens.element_size()
    return total


def prefill_flops(model: LlamaForCausalLM, prompt_len: int) -> float:
    cfg = model.cfg
    linear = 2 * matmul_params(cfg) * prompt_len
    attention = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * prompt_len**2 / 2
    lm_head = 2 * cfg.hidden_size * cfg.vocab_size
    return linear + attention + lm_head


def decode_flops(model: LlamaForCausalLM, batch: int, context: float) -> float:
    cfg = model.cfg
    linear = 2 * (matmul_params(cfg) + cfg.hidden_size * cfg.vocab_size) * batch
    attention = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context * batch
    return linear + attention


def _prompts(vocab: int, batch: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab, (batch, length), generator=gen).tolist()


def ours_decode(parts: Components, cfg: EngineConfig, batch: int, prompt: int, steps: int) -> float:
    engine = Engine(
        parts.model, parts.new_pool(), parts.tokenizer, scheduler_limits(cfg), parts.max_model_len
    )
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(_prompts(parts.model.cfg.vocab_size, batch, prompt)):
        engine.add_request(str(i), ids, params)
    engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return batch * steps / (time.perf_counter() - t0)


def ours_prefill(parts: Components, cfg: EngineConfig, batch: int, prompt: int) -> float:
    engine = Engine(
        parts.model, parts.new_pool(), parts.tokenizer, scheduler_limits(cfg), parts.max_model_len
    )
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(_prompts(parts.model.cfg.vocab_size, batch, prompt)):
        engine.add_request(str(i), ids, params)
    t0 = time.perf_counter()
    engine.step()
    return batch * prompt / (time.perf_counter() - t0)


def hf_model(model: str, parts: Components, dtype: torch.dtype) -> torch.nn.Module:
    """The same weights in transformers (imported here: it is a benchmark-only dependency)."""
    import transformers

    if model != "tiny":
        return transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval()
    hf_cfg = {k: v for k, v in TINY_HF_CONFIG.items() if k not in ("architectures", "model_type")}
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_cfg)).to(dtype)
    hf.load_state_dict(to_hf_state_dict(parts.model))
    return hf.eval()


@torch.inference_mode()
def hf_decode(hf: torch.nn.Module, vocab: int, batch: int, prompt: int, steps: int) -> float:
    ids = torch.tensor(_prompts(vocab, batch, prompt))
    kwargs = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    t0 = time.perf_counter()
    hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf.generate(ids, max_new_tokens=steps + 1, min_new_tokens=steps + 1, **kwargs)
    return batch * steps / (time.perf_counter() - t0 - first)


@torch.inference_mode()
def hf_prefill(hf: torch.nn.Module, vocab: int, batch: int, prompt: int) -> float:
    ids = torch.tensor(_prompts(vocab, batch, prompt))
    t0 = time.perf_counter()
    hf(ids, logits_to_keep=1)
    return batch * prompt / (time.perf_counter() - t0)


def bench_model(args: argparse.Namespace, model: str, bw: float, flops: float) -> list[Row]:
    cfg = EngineConfig(
        model=model, dtype=args.dtype, max_model_len=args.prompt_len + args.steps + 8
    )
    parts = build_components(cfg)
    hf = hf_model(model, parts, getattr(torch, args.dtype))
    vocab = parts.model.cfg.vocab_size
    kv_token_bytes = parts.layout.block_bytes // parts.layout.block_size
    name = "tiny" if model == "tiny" else Path(model).name
    rows = []
    jobs = [("decode", b) for b in args.batches] + [("prefill", args.prefill_batch)]
    for phase, batch in tqdm(jobs, desc=f"bench {name}"):
        if phase == "decode":
            ours = max(
                ours_decode(parts, cfg, batch, args.decode_prompt, args.steps)
                for _ in range(args.repeats)
            )
            theirs = max(
                hf_decode(hf, vocab, batch, args.decode_prompt, args.steps)
                for _ in range(args.repeats)
            )
            ctx = args.decode_prompt + args.steps / 2
            step_bytes = weight_bytes(parts.model) + batch * ctx * kv_token_bytes
            step_s = max(step_bytes / bw, decode_flops(parts.model, batch, ctx) / flops)
            limit = batch / step_s
        else:
            ours = max(
                ours_prefill(parts, cfg, batch, args.prompt_len) for _ in range(args.repeats)
            )
            theirs = max(hf_prefill(hf, vocab, batch, args.prompt_len) for _ in range(args.repeats))
            limit = args.prompt_len * flops / prefill_flops(parts.model, args.prompt_len)
        rows.append(Row(name, phase, batch, ours, theirs, limit))
    return rows


def plot(rows: list[dict[str, float | int | str]], path: Path) -> None:
    """Bars of Splitserve, transformers and the roofline limit per cell, one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({str(r["model"]) for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        cells = [r for r in rows if r["model"] == model]
        xs = range(len(cells))
        for offset, key, label in (
            (-0.27, "ours_tok_s", "Splitserve"),
            (0.0, "hf_tok_s", "transformers"),
            (0.27, "limit_tok_s", "roofline limit"),
        ):
            ax.bar([x + offset for x in xs], [float(c[key]) for c in cells], 0.27, label=label)
        ax.set_xticks(list(xs), [f"{c['phase']}\nbatch {c['batch']}" for c in cells])
        ax.set_yscale("log")
        ax.set_ylabel("tokens/s")
        ax.set_title(model)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", action="append", help="'tiny' or a checkpoint dir (repeatable)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per run")
    ap.add_argument("--decode-prompt", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--prefill-batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="best of N per cell")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path, help="write a PNG bar chart here")
    args = ap.parse_args()
    bw, flops = memory_bandwidth(), measure_rates("cpu", args.dtype).matmul_flops
    print(
        f"threads={torch.get_num_threads()} copy bandwidth={bw / 1e9:.1f} GB/s "
        f"matmul={flops / 1e9:.1f} GFLOP/s ({args.dtype})"
    )
    rows = [r for m in args.model or ["tiny"] for r in bench_model(args, m, bw, flops)]
    print(
        f"{'model':<12}{'phase':<9}{'batch':>6}{'ours tok/s':>12}{'HF tok/s':>10}"
        f"{'ours/HF':>9}{'limit tok/s':>13}{'of limit':>10}"
    )
    for r in rows:
        print(
            f"{r.model:<12}{r.phase:<9}{r.batch:>6}{r.ours_tok_s:>12.1f}{r.hf_tok_s:>10.1f}"
            f"{r.ratio:>9.2f}{r.limit_tok_s:>13.1f}{r.fraction:>10.1%}"
        )
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    if args.plot:
        plot([asdict(r) for r in rows], args.plot)


if __name__ == "__main__":
    main()
