"""On CUDA, the engine's greedy output equals transformers' (on CPU, fp32) token for token: the
Triton kernels in the whole model, not only each against its reference. Runs in
``scripts/gpu_check.sh``; skips without a GPU."""

import pytest
import torch
from hf_reference import hf_greedy

from splitserve import LLM, SamplingParams
from splitserve.tokenizer import load_tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A",
    "café 東京 😀 and a much longer prompt that spans several blocks of the paged cache, "
    "so that the block table of this request has more than one entry in it.",
]


@pytest.mark.parametrize("name", ["llama32_ckpt", "qwen2_ckpt", "mistral_swa_ckpt"])
def test_cuda_greedy_equals_transformers(name, request):
    ckpt = request.getfixturevalue(name)
    llm = LLM(str(ckpt), device="cuda", max_model_len=256, num_kv_blocks=128, block_size=8)
    tok = load_tokenizer(ckpt)
    prompts = [tok.encode(t) for t in TEXTS]
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    for ids, out in zip(prompts, outs, strict=True):
        assert out.token_ids == hf_greedy(ckpt, ids, 32, eos_token_ids=())
    assert llm.engine.scheduler.allocator.num_used == 0
