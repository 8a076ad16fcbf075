"""The built-in ``tiny`` model: a small Llama with deterministic random weights.

It lets the server and the tests start with nothing downloaded; its tokenizer is the byte-level
fallback, so its vocabulary is exactly the 256 bytes and 3 special ids.
"""

from __future__ import annotations

import torch

from splitserve.model.hf_config import ModelConfig
from splitserve.model.llama import LlamaForCausalLM

TINY_HF_CONFIG: dict[str, object] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 259,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 256,
    "eos_token_id": 257,
}


def tiny_config() -> ModelConfig:
    return ModelConfig.from_dict(TINY_HF_CONFIG)


def init_random_weights(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Deterministic weights scaled so greedy decoding wanders instead of repeating one token."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        if "layernorm" in name or name == "norm":
            values = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
        elif param.dim() == 1:
            values = 0.1 * torch.randn(param.shape, generator=gen)
        else:
            fan_in = param.shape[1]
            std = 1.0 if name == "embed_tokens" else 2.0 / fan_in**0.5
            values = std * torch.randn(param.shape, generator=gen)
        param.data.copy_(values.to(param.dtype))
