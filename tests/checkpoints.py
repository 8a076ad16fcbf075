"""Settings of the small random checkpoints the tests build (`from checkpoints import ...`)."""

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


LLAMA32_SETTINGS: dict[str, object] = {
    "arch": "llama",
    "hidden_size": 128,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 256,
    "vocab_size": 1024,
    "tie_word_embeddings": True,
    "rope_scaling": LLAMA3_ROPE,
    "rope_theta": 500000.0,
    "tokenizer": "llama3",
}
"""Llama 3.2-like: GQA 4q/2kv, tied embeddings, llama3 RoPE, legacy config, llama3 tokenizer."""
