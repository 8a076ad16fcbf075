"""Hugging Face transformers as the reference for token-for-token engine tests (test-only).

Import as ``from hf_reference import hf_greedy`` (pytest puts ``tests/`` on ``sys.path``).
Models load once per directory, in fp32 with eager attention.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel


@functools.lru_cache(maxsize=8)
def _load(ckpt_dir: str) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(
        ckpt_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def load_hf_model(ckpt_dir: str | Path) -> PreTrainedModel:
    """The checkpoint as a transformers model (fp32, eager, eval); cached by path, so never
    rewrite a checkpoint in place between calls."""
    return _load(str(Path(ckpt_dir).resolve()))


def checkpoint_eos_ids(ckpt_dir: str | Path) -> list[int]:
    """EOS ids transformers stops on: generation_config.json's, else config.json's."""
    eos = load_hf_model(ckpt_dir).generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


@torch.inference_mode()
def hf_greedy(
    ckpt_dir: str | Path,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    eos_token_ids: Sequence[int] | None = None,
) -> list[int]:
    """Greedy continuation of ``prompt_ids`` by the transformers model with its KV cache.

    Stops after ``max_new_tokens`` or on an EOS id, which is then the last id returned.
    ``eos_token_ids`` None means the checkpoint's; pass ``()`` to never stop early (ignore_eos).
    A plain loop over ``model(...)``: ``generate`` falls back to the checkpoint's EOS ids when
    given none, so it cannot express ignore_eos.
    """
    model = load_hf_model(ckpt_dir)
    eos = set(checkpoint_eos_ids(ckpt_dir) if eos_token_ids is None else eos_token_ids)
    # Newer transformers name the cache argument ``cache``, older ones ``past_key_values``.
    params = inspect.signature(model.forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"
    out = model(torch.tensor([list(prompt_ids)], dtype=torch.long), use_cache=True)
    tokens: list[int] = []
    while True:
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        if token in eos or len(tokens) == max_new_tokens:
            return tokens
        out = model(torch.tensor([[token]]), use_cache=True, **{cache_arg: out.past_key_values})


@torch.inference_mode()
def hf_logits(ckpt_dir: str | Path, ids: Sequence[int]) -> torch.Tensor:
    """fp32 logits ``[len(ids), vocab_size]`` of one forward pass over ``ids`` (no cache)."""
    model = load_hf_model(ckpt_dir)
    return model(torch.tensor([list(ids)], dtype=torch.long), use_cache=False).logits[0].float()


def assert_greedy_equals_hf(
    llm: Any, ckpt_dir: Path, texts: Sequence[str], max_tokens: int
) -> None:
    """``llm`` (a ``splitserve.LLM`` on ``ckpt_dir``) generates each of ``texts`` greedily,
    ``max_tokens`` tokens without stopping, exactly as transformers does, and frees every block."""
    from splitserve import SamplingParams
    from splitserve.tokenizer import load_tokenizer

    tok = load_tokenizer(ckpt_dir)
    prompts = [tok.encode(t) for t in texts]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for ids, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(ckpt_dir, ids, max_tokens, eos_token_ids=())
    assert llm.engine.scheduler.allocator.num_used == 0
