"""The served model: its public name, the Triton model behind it, and what the frontend reads
from its checkpoint (chat template, tokenizer, context length).

The checkpoint directory is ``--model-dir`` or else the ``model`` parameter of the Triton model's
config (when that directory exists here); the context length is ``--max-model-len``, else the
config's ``max_model_len`` parameter, else the checkpoint's ``max_position_embeddings``. They are
looked up on first use, so the frontend may start before Triton is up.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

from splitserve.engine_config import EngineConfig
from splitserve.openai.chat_template import ChatTemplate
from splitserve.openai.errors import bad_request
from splitserve.openai.options import OpenAIOptions
from splitserve.openai.triton_bridge import TritonBridge
from splitserve.serving.serving_config import CONFIG_PARAMETER, ServingConfig
from splitserve.tokenizer import Tokenizer, load_tokenizer


@dataclass(frozen=True)
class ModelInfo:
    model_dir: Path | None
    max_model_len: int | None
    tokenizer: Tokenizer
    template: ChatTemplate

    def default_max_tokens(self, prompt: str) -> int | None:
        """What is left of the context after ``prompt`` (vLLM's chat default), or None (the
        server's default) when the context length is unknown."""
        if self.max_model_len is None:
            return None
        used = len(self.tokenizer.encode(prompt))
        if used >= self.max_model_len:
            raise bad_request(
                f"the prompt has {used} tokens; this model's context length is "
                f"{self.max_model_len}",
                "messages",
            )
        return self.max_model_len - used


def build_info(
    model_dir: Path | None, max_model_len: int | None, chat_template: str | None
) -> ModelInfo:
    tokenizer = load_tokenizer(model_dir)
    adds_bos = tokenizer.bos_token_id is not None and tokenizer.encode("")[:1] == [
        tokenizer.bos_token_id
    ]
    template = ChatTemplate.load(model_dir, chat_template, strip_bos=adds_bos)
    _ = template.template  # a template that does not compile fails here, not per request
    return ModelInfo(model_dir, max_model_len, tokenizer, template)


def _context_length(model_dir: Path | None) -> int | None:
    config = model_dir / "config.json" if model_dir else None
    if config is None or not config.is_file():
        return None
    value = json.loads(config.read_text()).get("max_position_embeddings")
    return int(value) if value else None


class ServedModel:
    def __init__(self, options: OpenAIOptions, bridge: TritonBridge) -> None:
        self.name = options.model_name
        self.triton_model = options.triton_model
        self._options = options
        self._bridge = bridge
        self._info: ModelInfo | None = None
        self._lock = asyncio.Lock()

    async def info(self) -> ModelInfo:
        if self._info is None:
            async with self._lock:
                if self._info is None:
                    self._info = await self._resolve()
        return self._info

    async def _resolve(self) -> ModelInfo:
        opts = self._options
        engine: EngineConfig | None = None
        if opts.model_dir is None or opts.max_model_len is None:
            params = await self._bridge.model_parameters(self.triton_model)
            if CONFIG_PARAMETER in params:
                engine = ServingConfig.from_json(params[CONFIG_PARAMETER]).engine
        model_dir = opts.model_dir
        if model_dir is None and engine is not None and Path(engine.model).is_dir():
            model_dir = Path(engine.model)
        max_len = opts.max_model_len
        if max_len is None and engine is not None:
            max_len = engine.max_model_len
        if max_len is None:
            max_len = _context_length(model_dir)
        return await asyncio.to_thread(build_info, model_dir, max_len, opts.chat_template)
