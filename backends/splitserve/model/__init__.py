"""Model definition, configuration and loading."""

from __future__ import annotations

from pathlib import Path

import torch

from splitserve.model.hf_config import ModelConfig
from splitserve.model.llama import LlamaForCausalLM
from splitserve.model.loader import load_weights
from splitserve.model.tiny import init_random_weights, tiny_config

TINY = "tiny"


def is_tiny(model: str | None) -> bool:
    return model in (None, "", TINY)


def load_model(
    model: str | None,
    dtype: torch.dtype,
    device: str = "cpu",
    max_positions: int = 0,
    progress: bool = False,
) -> LlamaForCausalLM:
    """``model`` is ``"tiny"``/None (built-in random weights) or a local Hugging Face directory."""
    if is_tiny(model):
        net = LlamaForCausalLM(tiny_config(), dtype, device, max_positions)
        init_random_weights(net)
        net.pack_weights()
        return net
    model_dir = Path(str(model))
    if not model_dir.is_dir():
        raise FileNotFoundError(
            f"model {model!r} is not a local directory "
            "(no hub access: pass a checkpoint path or 'tiny')"
        )
    net = LlamaForCausalLM(ModelConfig.from_dir(model_dir), dtype, device, max_positions)
    load_weights(net, model_dir, progress)
    net.pack_weights()
    return net


__all__ = ["TINY", "LlamaForCausalLM", "ModelConfig", "is_tiny", "load_model"]
