"""Greedy output of the engine equals transformers' token for token on the same weights."""

import json
import shutil

import pytest
from hf_reference import assert_greedy_equals_hf, hf_greedy

from splitserve import LLM, SamplingParams
from splitserve.model.hf_config import ModelConfig
from splitserve.model.linear import HALF_MATMUL_ENV
from splitserve.tokenizer import load_tokenizer

CKPTS = ["llama32_ckpt", "qwen2_ckpt", "mistral_ckpt", "mistral_swa_ckpt", "llama_bytes_ckpt"]
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time",
    "café 東京 😀 and a much longer prompt that spans several blocks of the paged cache, "
    "so that the block table of this request has more than one entry in it.",
    "A",
    # Past one 64-token tile of the CPU prefill attention kernel (80+ tokens).
    "Numbers 1234 5678, names like Ada and Grace, words: attention, cache, block, "
    "decode, prefill; symbols #@!? and more text so that the prompt runs past one tile.",
]


@pytest.mark.parametrize("name", CKPTS)
def test_greedy_equals_transformers(name, request):
    ckpt = request.getfixturevalue(name)
    llm = LLM(str(ckpt), max_model_len=256, num_kv_blocks=128, block_size=8)
    assert_greedy_equals_hf(llm, ckpt, TEXTS, 40)


def test_stops_on_eos_like_transformers(llama32_ckpt):
    llm = LLM(str(llama32_ckpt), max_model_len=256, num_kv_blocks=128)
    tok = load_tokenizer(llama32_ckpt)
    for text in TEXTS:
        ids = tok.encode(text)
        out = llm.generate([ids], SamplingParams(max_tokens=60, temperature=0.0), use_tqdm=False)[0]
        ref = hf_greedy(llama32_ckpt, ids, 60)
        assert out.token_ids == ref
        assert out.finish_reason == ("stop" if ref[-1] in tok.eos_token_ids else "length")


def test_legacy_and_new_rope_layouts_parse_the_same(llama32_ckpt, tmp_path):
    cfg = json.loads((llama32_ckpt / "config.json").read_text())
    rope = dict(cfg.pop("rope_scaling"), rope_theta=cfg.pop("rope_theta"))
    cfg["rope_parameters"] = rope
    assert ModelConfig.from_dict(cfg) == ModelConfig.from_dir(llama32_ckpt)


@pytest.mark.parametrize("half_matmul", ["onednn", "widened"])
def test_bfloat16_load_runs(mistral_ckpt, half_matmul, monkeypatch):
    # Both matmul paths for bfloat16 weights, whichever this CPU would pick.
    monkeypatch.setenv(HALF_MATMUL_ENV, half_matmul)
    llm = LLM(str(mistral_ckpt), dtype="bfloat16", max_model_len=128, num_kv_blocks=64)
    out = llm.generate(
        ["hello"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0]
    assert len(out.token_ids) == 8


def test_unknown_architecture_and_missing_files_are_named(llama32_ckpt, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(llama32_ckpt, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(str(bad))
    cfg["architectures"] = ["LlamaForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        LLM(str(bad))
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        LLM(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        LLM(str(tmp_path / "empty"))
