"""Offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from splitserve.engine.build import build_components, scheduler_limits
from splitserve.engine.engine import Engine
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine_config import EngineConfig


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


class LLM:
    def __init__(self, model: str = "tiny", dtype: str = "float32", **kwargs: Any) -> None:
        self.config = EngineConfig(model=model, dtype=dtype, **kwargs)
        parts = build_components(self.config, progress=True)
        self.tokenizer = parts.tokenizer
        self.engine = Engine(
            parts.model,
            parts.new_pool(),
            parts.tokenizer,
            scheduler_limits(self.config),
            parts.max_model_len,
        )
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | Sequence[str | list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[CompletionOutput]:
        """Runs every prompt to completion in one continuous batch; outputs in prompt order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError("sampling_params must be one per prompt")
        results: dict[str, CompletionOutput] = {}
        try:
            for prompt, p in zip(prompts, per_prompt, strict=True):
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                rid = str(next(self._ids))
                self.engine.add_request(rid, ids, p)
                results[rid] = CompletionOutput(rid, ids)
        except ValueError:
            for rid in results:
                self.engine.abort(rid)
            raise
        with tqdm(total=len(results), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    res = results[out.request_id]
                    res.text += out.new_text
                    res.token_ids += out.new_token_ids
                    if out.finished:
                        res.finish_reason = out.finish_reason
                        bar.update(1)
        return list(results.values())
