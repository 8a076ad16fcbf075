"""Llama-family decoder (Llama 2/3/3.x, Qwen2, Mistral) over a paged KV cache.

The q, k and v projections are fused into one matmul; the loader slices Hugging Face tensors
into it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, cast, overload

import torch
import torch.nn.functional as F
from torch import nn

import splitserve_kernels as kernels
from splitserve.model.batch import ForwardBatch
from splitserve.model.hf_config import ModelConfig
from splitserve.model.linear import Packed, linear, pack
from splitserve.model.rope import RotaryEmbedding


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.index = index
        self.cfg = cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_size, self.kv_size = q, kv
        self.input_layernorm = _param(cfg.hidden_size, dtype=dtype, device=device)
        self.qkv_proj = _param(q + 2 * kv, cfg.hidden_size, dtype=dtype, device=device)
        self.qkv_bias = (
            _param(q + 2 * kv, dtype=dtype, device=device) if cfg.attention_bias else None
        )
        self.o_proj = _param(cfg.hidden_size, q, dtype=dtype, device=device)
        self.post_attention_layernorm = _param(cfg.hidden_size, dtype=dtype, device=device)
        self.gate_proj = _param(cfg.intermediate_size, cfg.hidden_size, dtype=dtype, device=device)
        self.up_proj = _param(cfg.intermediate_size, cfg.hidden_size, dtype=dtype, device=device)
        self.down_proj = _param(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, device=device)
        self.scale = cfg.head_dim**-0.5
        self.packed: dict[str, Packed | None] = {}

    def pack_weights(self) -> None:
        """Pre-pack the projection matrices where the platform supports it (see linear.py)."""
        self.packed = {
            name: pack(getattr(self, name))
            for name in ("qkv_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        }

    def forward(
        self,
        h: torch.Tensor,
        pending: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        cache: torch.Tensor,
        written: Callable[[int], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(residual, mlp_out)``: ``pending`` is the previous layer's MLP output, added to the
        residual stream ``h`` by the norm that reads it (None before the first layer).
        ``written(index)`` runs once this layer's KV of the batch is in ``cache``."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        if pending is None:
            x = kernels.rms_norm(h, self.input_layernorm, eps)
        else:
            x, h = kernels.add_rms_norm(pending, h, self.input_layernorm, eps)
        packed = self.packed
        qkv = linear(x, self.qkv_proj, self.qkv_bias, packed.get("qkv_proj"))
        q = kernels.rotary_write_kv(
            qkv, cos, sin, cfg.num_heads, cache, self.index, batch.slot_blocks, batch.slot_offsets
        )
        if written is not None:
            written(self.index)
        attn = self._attention(q, batch, cache)
        o = linear(attn.reshape(attn.shape[0], -1), self.o_proj, None, packed.get("o_proj"))
        x, h = kernels.add_rms_norm(o, h, self.post_attention_layernorm, eps)
        # Separate gate/up matmuls: halves of one fused output are strided, and silu/mul on
        # strided views run several times slower than on contiguous tensors.
        act = kernels.silu_mul_(
            linear(x, self.gate_proj, None, packed.get("gate_proj")),
            linear(x, self.up_proj, None, packed.get("up_proj")),
        )
        return h, linear(act, self.down_proj, None, packed.get("down_proj"))

    def _attention(self, q: torch.Tensor, batch: ForwardBatch, cache: torch.Tensor) -> torch.Tensor:
        """Attention of ``q`` over the keys and values already in ``cache`` (this batch's too)."""
        window = self.cfg.sliding_window
        if batch.is_decode:
            assert batch.block_tables is not None and batch.seq_lens is not None
            return kernels.paged_decode_attention(
                q, cache, self.index, batch.block_tables, batch.seq_lens, self.scale, window
            )
        assert batch.cu_seqlens_q is not None and batch.seq_block_tables is not None
        return kernels.paged_prefill_attention(
            q,
            cache,
            self.index,
            batch.seq_block_tables,
            batch.cu_seqlens_q,
            batch.cu_seqlens_k,
            self.scale,
            window,
        )


if TYPE_CHECKING:

    class _DecoderLayers(nn.ModuleList):
        """How mypy sees ``LlamaForCausalLM.layers``: torch types a ModuleList's items as plain
        ``Module`` (it is not generic); every item of this one is a DecoderLayer."""

        @overload
        def __getitem__(self, idx: slice) -> nn.ModuleList: ...
        @overload
        def __getitem__(self, idx: int) -> DecoderLayer: ...
        def __getitem__(self, idx: int | slice) -> DecoderLayer | nn.ModuleList: ...
        def __iter__(self) -> Iterator[DecoderLayer]: ...


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, device: str = "cpu", max_positions: int = 0
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = cast(
            "_DecoderLayers",
            nn.ModuleList(DecoderLayer(cfg, i, dtype, device) for i in range(cfg.num_layers)),
        )
        self.norm = _param(cfg.hidden_size, dtype=dtype, device=device)
        self.lm_head = (
            self.embed_tokens
            if cfg.tie_word_embeddings
            else _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        )
        self.rotary = RotaryEmbedding(
            cfg.rope, cfg.head_dim, max_positions or cfg.max_position_embeddings, device
        )
        self.lm_head_packed: Packed | None = None

    def pack_weights(self) -> None:
        """Call once the weights are final: pre-packs every matmul weight where supported."""
        for layer in self.layers:
            layer.pack_weights()
        self.lm_head_packed = pack(self.lm_head)

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        cache: torch.Tensor,
        written: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Logits ``[len(batch.logits_indices), vocab]`` in the model's dtype (the sampler widens
        them only where it needs to); writes the batch's KV, calling ``written(layer)`` as each
        layer's is in place (a prompt pass that streams its KV by layer)."""
        h = F.embedding(batch.input_ids, self.embed_tokens)
        cos, sin = self.rotary.tables(batch.positions, self.dtype)
        pending = None
        for layer in self.layers:
            h, pending = layer(h, pending, cos, sin, batch, cache, written)
        assert pending is not None, "a model has at least one layer"
        rows = batch.logits_indices
        x, _ = kernels.add_rms_norm(pending[rows], h[rows], self.norm, self.cfg.rms_norm_eps)
        return linear(x, self.lm_head, None, self.lm_head_packed)
