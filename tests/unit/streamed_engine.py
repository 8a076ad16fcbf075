"""A decode engine on the tiny model with a puller, as a server's takes handed-over requests
whose KV arrives while they wait (streamed or pushed)."""

from concurrent.futures import Executor

from splitserve.engine.build import Components, scheduler_limits
from splitserve.engine.engine import Engine
from splitserve.engine_config import EngineConfig


def decode_engine(parts: Components, puller: Executor) -> Engine:
    cfg = EngineConfig(model="tiny", num_kv_blocks=64)
    return Engine(
        parts.model,
        parts.new_pool(),
        parts.tokenizer,
        scheduler_limits(cfg),
        parts.max_model_len,
        puller=puller,
    )
