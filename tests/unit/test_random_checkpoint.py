from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hf_reference import checkpoint_eos_ids, hf_greedy, hf_logits, load_hf_model
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from splitserve.testing.checkpoints import PRESETS, main, write_random_checkpoint
from splitserve.tokenizer import load_tokenizer

CKPTS = ["llama32_ckpt", "qwen2_ckpt", "mistral_ckpt", "mistral_swa_ckpt", "llama_bytes_ckpt"]
PROMPTS = ["The old lighthouse keeper", "café 東京 😀", "def fibonacci(n):"]
TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)


@pytest.fixture(params=CKPTS)
def ckpt(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(request.param)


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return out


def test_transformers_loads_every_weight(ckpt: Path) -> None:
    _, info = AutoModelForCausalLM.from_pretrained(
        ckpt, output_loading_info=True, dtype=torch.float32
    )
    assert {k: v for k, v in info.items() if v} == {}
    config = json.loads((ckpt / "config.json").read_text())
    names = set(_tensors(ckpt))
    assert ("lm_head.weight" in names) == (not config["tie_word_embeddings"])
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == (config["model_type"] == "qwen2")


def test_greedy_output_is_diverse_with_clear_margins(ckpt: Path) -> None:
    tok = load_tokenizer(ckpt)
    gaps = []
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        out = hf_greedy(ckpt, ids, 40, eos_token_ids=())
        assert len(out) == 40 and len(set(out)) >= 20, out
        assert sum(i < tok.vocab_size for i in out) >= 36
        top2 = hf_logits(ckpt, ids + out[:-1])[len(ids) - 1 :].topk(2).values
        gaps += (top2[:, 0] - top2[:, 1]).tolist()
    assert sorted(gaps)[len(gaps) // 2] > 0.5
    assert min(gaps) > 1e-4


def test_hf_greedy_stops_on_eos(mistral_ckpt: Path) -> None:
    full = hf_greedy(mistral_ckpt, [1, 100, 200], 20, eos_token_ids=())
    assert hf_greedy(mistral_ckpt, [1, 100, 200], 20, eos_token_ids=[full[5]]) == full[:6]
    assert checkpoint_eos_ids(mistral_ckpt) == [2]


def test_config_fields(llama32_ckpt: Path, qwen2_ckpt: Path, mistral_swa_ckpt: Path) -> None:
    llama = json.loads((llama32_ckpt / "config.json").read_text())
    assert llama["architectures"] == ["LlamaForCausalLM"]
    assert llama["torch_dtype"] == "float32" and llama["rope_theta"] == 500000.0
    assert llama["rope_scaling"]["rope_type"] == "llama3"
    assert llama["eos_token_id"] == checkpoint_eos_ids(llama32_ckpt) == [1022, 1023]
    qwen = json.loads((qwen2_ckpt / "config.json").read_text())
    assert qwen["attention_bias"] and "rope_theta" not in qwen and "rope_scaling" not in qwen
    assert qwen["rope_parameters"] == {"rope_type": "default", "rope_theta": 1000000.0}
    assert load_hf_model(mistral_swa_ckpt).config.sliding_window == 16


def test_qwen2_sliding_window_covers_every_layer(tmp_path: Path) -> None:
    out = write_random_checkpoint(tmp_path, arch="qwen2", **TINY, vocab_size=512, sliding_window=8)
    config = AutoConfig.from_pretrained(out)
    assert config.sliding_window == 8 and set(config.layer_types) == {"sliding_attention"}


@pytest.mark.parametrize(
    "rope_scaling",
    [
        None,
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_config_layouts_mean_the_same(tmp_path: Path, rope_scaling: dict | None) -> None:
    parsed = []
    for layout in ("legacy", "rope_parameters"):
        out = write_random_checkpoint(
            tmp_path / layout,
            **TINY,
            vocab_size=300,
            tokenizer=None,
            rope_theta=20000.0,
            rope_scaling=rope_scaling,
            config_layout=layout,
        )
        rope = dict(AutoConfig.from_pretrained(out).rope_parameters)
        parsed.append(rope)
        if layout == "legacy" and rope_scaling and rope_scaling["rope_type"] == "linear":
            assert rope.pop("type") == "linear"
    assert parsed[0] == parsed[1]
    assert parsed[0]["rope_theta"] == 20000.0
    assert parsed[0]["rope_type"] == (rope_scaling or {"rope_type": "default"})["rope_type"]


def test_shards_and_index(mistral_ckpt: Path) -> None:
    shards = sorted(p.name for p in mistral_ckpt.glob("*.safetensors"))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.loads((mistral_ckpt / "model.safetensors.index.json").read_text())
    tensors = _tensors(mistral_ckpt)
    assert set(index["weight_map"]) == set(tensors)
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in tensors.values()
    )


def test_deterministic_from_seed(tmp_path: Path) -> None:
    def write(name: str, seed: int) -> Path:
        return write_random_checkpoint(
            tmp_path / name, **TINY, vocab_size=512, tokenizer="llama3", seed=seed
        )

    a, b, c = write("a", 0), write("b", 0), write("c", 1)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_norm_weights_near_one_and_half_precision(tmp_path: Path) -> None:
    out = write_random_checkpoint(
        tmp_path, **TINY, vocab_size=512, dtype="bfloat16", num_shards=3, tie_word_embeddings=True
    )
    tensors = _tensors(out)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    norm = tensors["model.norm.weight"].float()
    assert (norm - 1).abs().max() < 0.6 and norm.std() > 0.01
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert len(list(out.glob("*.safetensors"))) == 3
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}


def test_rewrite_removes_stale_files(tmp_path: Path) -> None:
    write_random_checkpoint(tmp_path, **TINY, vocab_size=512, num_shards=2)
    write_random_checkpoint(tmp_path, **TINY, vocab_size=512, tokenizer=None)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors"]
    assert json.loads((tmp_path / "config.json").read_text())["bos_token_id"] == 256


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(arch="gpt2"),
        dict(dtype="int8"),
        dict(num_heads=3),
        dict(arch="llama", sliding_window=8),
        dict(arch="qwen2", head_dim=64),
        dict(tokenizer=None, vocab_size=100),
        dict(tokenizer="bpe", vocab_size=200),
        dict(num_shards=9),
    ],
)
def test_rejects_bad_arguments(tmp_path: Path, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        write_random_checkpoint(tmp_path, **{**TINY, "vocab_size": 512, **kwargs})


def test_cli_tiny_preset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main([str(tmp_path / "tiny"), "--preset", "tiny", "--dtype", "bfloat16"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "tiny")
    config = json.loads((tmp_path / "tiny" / "config.json").read_text())
    assert config["vocab_size"] == PRESETS["tiny"]["vocab_size"] == 2048
    assert config["hidden_size"] == 256 and config["torch_dtype"] == "bfloat16"


def test_100m_preset_size() -> None:
    p = PRESETS["100m"]
    h, inter = p["hidden_size"], p["intermediate_size"]
    kv = h // p["num_heads"] * p["num_kv_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h
    total = 2 * p["vocab_size"] * h + p["num_layers"] * per_layer + h
    assert 100e6 <= total <= 130e6, math.floor(total / 1e6)
