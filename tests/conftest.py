"""Shared fixtures: small random-weight Hugging Face checkpoints, built once per session.

All are fp32 with weights scaled for diverse greedy output and clear top-1 margins, so an fp32
engine must match ``hf_reference.hf_greedy`` token for token. Each returns the checkpoint directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from checkpoints import LLAMA32_SETTINGS

from splitserve.testing.checkpoints import write_random_checkpoint

if not torch.cuda.is_available():
    # Triton kernels run in Triton's interpreter on CPU tensors. ``triton.jit`` reads this when a
    # function is decorated, triton's own library included, so it must be set before anything
    # imports triton: here, the first conftest pytest loads.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests never read or fill the user's profile cache, and a profile one test caches must not turn
# another test's `splitserve serve` into the planner's choice: off unless a test sets its own.
os.environ["SPLITSERVE_PROFILE_CACHE"] = "none"


@pytest.fixture(scope="session")
def llama32_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``LLAMA32_SETTINGS`` with a 512-token context."""
    return write_random_checkpoint(
        tmp_path_factory.mktemp("llama32"), **LLAMA32_SETTINGS, max_position_embeddings=512
    )


@pytest.fixture(scope="session")
def qwen2_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2-like: q/k/v bias, rope_parameters config, GQA 4q/2kv, llama3 tokenizer, vocab 4096."""
    return write_random_checkpoint(
        tmp_path_factory.mktemp("qwen2"),
        arch="qwen2",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=176,
        vocab_size=4096,
        rope_theta=1000000.0,
        config_layout="rope_parameters",
        tokenizer="llama3",
    )


@pytest.fixture(scope="session")
def mistral_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MQA 4q/1kv, head_dim 64 != hidden/heads, linear RoPE, bpe tokenizer, 2 shards."""
    return write_random_checkpoint(
        tmp_path_factory.mktemp("mistral"),
        arch="mistral",
        hidden_size=128,
        num_layers=3,
        num_heads=4,
        num_kv_heads=1,
        head_dim=64,
        intermediate_size=256,
        vocab_size=512,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        num_shards=2,
        tokenizer="bpe",
    )


@pytest.fixture(scope="session")
def mistral_swa_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mistral with sliding_window=16 on every layer, rope_parameters config, bpe tokenizer."""
    return write_random_checkpoint(
        tmp_path_factory.mktemp("mistral_swa"),
        arch="mistral",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=176,
        vocab_size=512,
        config_layout="rope_parameters",
        sliding_window=16,
        tokenizer="bpe",
    )


@pytest.fixture(scope="session")
def llama_bytes_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama without tokenizer files (ByteTokenizer: BOS 256, EOS 257), vocab 384, MHA."""
    return write_random_checkpoint(
        tmp_path_factory.mktemp("llama_bytes"),
        arch="llama",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        intermediate_size=176,
        vocab_size=384,
        tokenizer=None,
    )
