"""The inverse of the loader: Hugging Face tensor names and shapes from the fused model."""

from __future__ import annotations

import torch

from splitserve.model.llama import LlamaForCausalLM


def to_hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    cfg = model.cfg
    out = {
        "model.embed_tokens.weight": model.embed_tokens.data,
        "model.norm.weight": model.norm.data,
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = model.lm_head.data
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, kv = layer.q_size, layer.kv_size
        parts = {
            "q_proj": slice(0, q),
            "k_proj": slice(q, q + kv),
            "v_proj": slice(q + kv, q + 2 * kv),
        }
        for name, rows in parts.items():
            out[f"{p}self_attn.{name}.weight"] = layer.qkv_proj.data[rows]
            if layer.qkv_bias is not None:
                out[f"{p}self_attn.{name}.bias"] = layer.qkv_bias.data[rows]
        out[f"{p}self_attn.o_proj.weight"] = layer.o_proj.data
        out[f"{p}mlp.gate_proj.weight"] = layer.gate_proj.data
        out[f"{p}mlp.up_proj.weight"] = layer.up_proj.data
        out[f"{p}mlp.down_proj.weight"] = layer.down_proj.data
        out[f"{p}input_layernorm.weight"] = layer.input_layernorm.data
        out[f"{p}post_attention_layernorm.weight"] = layer.post_attention_layernorm.data
    return {k: v.contiguous() for k, v in out.items()}
