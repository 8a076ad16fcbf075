"""Load Hugging Face safetensors checkpoints (single file or sharded) into the fused model.

Tensors are read one at a time and copied into pre-allocated parameters of the target dtype,
so the peak is the model plus one tensor, never two copies of the checkpoint.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from splitserve.model.llama import LlamaForCausalLM

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"shards listed in {index.name} are missing: {missing}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"no model.safetensors or model.safetensors.index.json in {model_dir} "
        "(only safetensors checkpoints are supported)"
    )


def _target(model: LlamaForCausalLM, name: str) -> tuple[torch.Tensor, slice]:
    """The parameter and row range that an expected HF tensor name fills."""
    if name == "model.embed_tokens.weight":
        return model.embed_tokens, slice(None)
    if name == "model.norm.weight":
        return model.norm, slice(None)
    if name == "lm_head.weight":
        return model.lm_head, slice(None)
    match = _LAYER.match(name)
    assert match is not None
    index, rest = int(match.group(1)), match.group(2)
    layer = model.layers[index]
    q, kv = layer.q_size, layer.kv_size
    qkv_rows = {
        "q_proj": slice(0, q),
        "k_proj": slice(q, q + kv),
        "v_proj": slice(q + kv, q + 2 * kv),
    }
    module, _, kind = rest.rpartition(".")
    short = module.split(".")[-1]
    if short in qkv_rows:
        param = layer.qkv_proj if kind == "weight" else layer.qkv_bias
        assert param is not None
        return param, qkv_rows[short]
    table: dict[str, tuple[torch.Tensor, slice]] = {
        "self_attn.o_proj.weight": (layer.o_proj, slice(None)),
        "mlp.gate_proj.weight": (layer.gate_proj, slice(None)),
        "mlp.up_proj.weight": (layer.up_proj, slice(None)),
        "mlp.down_proj.weight": (layer.down_proj, slice(None)),
        "input_layernorm.weight": (layer.input_layernorm, slice(None)),
        "post_attention_layernorm.weight": (layer.post_attention_layernorm, slice(None)),
    }
    return table[rest]


def _expected(model: LlamaForCausalLM) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not model.cfg.tie_word_embeddings:
        names.add("lm_head.weight")
    per_layer = [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    ]
    if model.cfg.attention_bias:
        per_layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    for i in range(model.cfg.num_layers):
        names.update(f"model.layers.{i}.{p}" for p in per_layer)
    return names


def _tensors(files: list[Path], device: str) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt", device=device) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def load_weights(model: LlamaForCausalLM, model_dir: Path, progress: bool = False) -> None:
    files = checkpoint_files(model_dir)
    expected = _expected(model)
    seen: set[str] = set()
    bar = tqdm(total=len(expected), desc="loading weights", unit="tensor", disable=not progress)
    for name, tensor in _tensors(files, "cpu"):
        if _IGNORED.search(name):
            continue
        if name not in expected:
            if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
                continue
            raise ValueError(f"unexpected tensor {name!r} in checkpoint {model_dir}")
        param, rows = _target(model, name)
        dst = param.data[rows]
        if dst.shape != tensor.shape:
            raise ValueError(
                f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects {tuple(dst.shape)}"
            )
        dst.copy_(tensor)
        seen.add(name)
        bar.update(1)
    bar.close()
    missing = sorted(expected - seen)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks {len(missing)} tensors, e.g. {missing[:3]}")
