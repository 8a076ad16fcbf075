"""Engine configuration: one frozen dataclass that checks itself."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("float32", "bfloat16", "float16")
"""Weight, activation and KV dtypes the engine runs in (torch dtype names)."""


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny"
    """``"tiny"`` (built-in random weights) or a local Hugging Face checkpoint directory."""
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None
    """Longest prompt + output; defaults to the model's ``max_position_embeddings``."""
    block_size: int = 16
    num_kv_blocks: int | None = None
    """KV pool size in blocks; derived from ``kv_cache_bytes`` when unset."""
    kv_cache_bytes: int = 512 << 20
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    chunked_prefill: bool = False
    prefix_cache: bool = True
    """Reuse the KV of prompt prefixes that earlier requests computed (``--no-prefix-cache``:
    off)."""
    num_threads: int | None = None
    """torch intra-op threads for this engine (None leaves torch's default)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        positive = ("block_size", "kv_cache_bytes", "max_num_seqs", "max_num_batched_tokens")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        for name in ("max_model_len", "num_kv_blocks", "num_threads"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive")
