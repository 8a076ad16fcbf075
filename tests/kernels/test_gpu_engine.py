"""On CUDA, the engine's greedy output equals transformers' (on CPU, fp32) token for token: the
Triton kernels in the whole model, not only each against its reference. Runs in
``scripts/gpu_check.sh``; skips without a GPU."""

import pytest
import torch
from hf_reference import assert_greedy_equals_hf

from splitserve import LLM

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
    assert_greedy_equals_hf(llm, ckpt, TEXTS, 32)
