"""Builds model, tokenizer and KV pool from an EngineConfig."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import splitserve_kernels as kernels
from splitserve.engine.scheduler import SchedulerLimits
from splitserve.engine_config import EngineConfig
from splitserve.kv.layout import KVLayout
from splitserve.kv.pool import KVPool
from splitserve.model import ModelConfig, is_tiny, load_model
from splitserve.model.llama import LlamaForCausalLM
from splitserve.tokenizer import Tokenizer, load_tokenizer


def eos_ids(tokenizer: Tokenizer, cfg: ModelConfig) -> tuple[int, ...]:
    """Tokens that end a generation: the tokenizer's, else the model config's."""
    return tuple(tokenizer.eos_token_ids) or cfg.eos_token_ids


@dataclass
class Components:
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    layout: KVLayout
    num_blocks: int
    max_model_len: int

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return eos_ids(self.tokenizer, self.model.cfg)

    def new_pool(self) -> KVPool:
        return KVPool(self.layout, self.num_blocks, self.model.embed_tokens.device)


def build_components(cfg: EngineConfig, progress: bool = False) -> Components:
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    model = load_model(cfg.model, getattr(torch, cfg.dtype), cfg.device, progress=progress)
    mcfg = model.cfg
    max_model_len = min(
        cfg.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings
    )
    if cfg.max_model_len and cfg.max_model_len > mcfg.max_position_embeddings:
        raise ValueError(
            f"max_model_len {cfg.max_model_len} exceeds the model's max_position_embeddings "
            f"({mcfg.max_position_embeddings})"
        )
    layout = KVLayout(mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim, cfg.block_size, cfg.dtype)
    num_blocks = cfg.num_kv_blocks or max(1, cfg.kv_cache_bytes // layout.block_bytes)
    if layout.blocks_for(max_model_len) > num_blocks:
        raise ValueError(
            f"the KV pool ({num_blocks} blocks of {cfg.block_size}) cannot hold one sequence of "
            f"max_model_len {max_model_len}; raise kv_cache_bytes or lower max_model_len"
        )
    tokenizer = load_tokenizer(None if is_tiny(cfg.model) else cfg.model)
    kernels.prepare(cfg.device)
    return Components(model, tokenizer, layout, num_blocks, max_model_len)


def scheduler_limits(cfg: EngineConfig) -> SchedulerLimits:
    return SchedulerLimits(
        block_size=cfg.block_size,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        chunked_prefill=cfg.chunked_prefill,
        prefix_cache=cfg.prefix_cache,
    )
