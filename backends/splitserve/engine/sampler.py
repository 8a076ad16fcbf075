"""Token sampling: greedy, temperature, top-k, top-p, min-p and penalties, seeded per token.

Randomness of a sampled token depends only on the request's seed and the token's index, so a
request's output does not depend on which batch it ran in or on which instance sampled it
(prefill samples the first token, decode the rest).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import splitserve_kernels as kernels
from splitserve.engine.request import Request
from splitserve.engine.sampling_params import SamplingParams

_MASK64 = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def token_generator(seed: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed + index * _GOLDEN) & _MASK64)


def suppressed_tokens(
    params: SamplingParams, num_generated: int, eos_ids: Sequence[int], vocab_size: int
) -> list[int]:
    """Tokens that may not be sampled yet: EOS and stop ids before ``min_tokens``."""
    if num_generated >= params.min_tokens:
        return []
    eos = () if params.ignore_eos else tuple(eos_ids)
    return [t for t in (*eos, *params.stop_token_ids) if t < vocab_size]


def apply_penalties(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """Repetition penalty (Hugging Face/CTRL, over prompt and output) and OpenAI's presence and
    frequency penalties (over the output)."""
    p = req.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.all_ids)), dtype=torch.long)
        vals = logits[seen]
        logits[seen] = torch.where(
            vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
        )
    if req.output_ids and (p.presence_penalty or p.frequency_penalty):
        counts = torch.bincount(torch.tensor(req.output_ids), minlength=logits.shape[0]).float()
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return logits


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[0]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def _sample_row(logits: torch.Tensor, req: Request) -> int:
    p = req.params
    if p.greedy:
        return int(torch.argmax(logits))
    logits = filter_logits(logits / p.temperature, p.top_k, p.top_p, p.min_p)
    probs = torch.softmax(logits, dim=-1)
    gen = token_generator(req.seed, len(req.output_ids))
    return int(torch.multinomial(probs, 1, generator=gen))


def sample(
    logits: torch.Tensor, reqs: Sequence[Request], suppress: Sequence[list[int]]
) -> list[int]:
    """One token per row of ``logits`` ``[B, vocab]`` (the model's dtype).

    ``suppress[i]`` lists token ids request ``i`` may not produce yet (EOS before min_tokens).
    A batch of plain greedy requests is answered from the logits as they are; anything else
    works on a float32 copy.
    """
    simple = all(r.params.greedy and not r.params.has_penalties for r in reqs) and not any(suppress)
    if simple:
        return kernels.greedy_tokens(logits).tolist()
    # Per-request sampling draws from CPU generators: the same draws on every device.
    logits = logits.float().cpu()
    out = []
    for i, req in enumerate(reqs):
        row = logits[i].clone()
        if req.params.has_penalties:
            row = apply_penalties(row, req)
        if suppress[i]:
            row[torch.tensor(suppress[i], dtype=torch.long)] = float("-inf")
        out.append(_sample_row(row, req))
    return out
