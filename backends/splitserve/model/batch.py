"""What one forward pass needs besides the weights: tokens, positions, KV slots, block tables."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """A packed batch of ``T`` new tokens from ``B`` sequences.

    Decode batches (``is_decode``) carry one token per sequence and use ``block_tables`` and
    ``seq_lens``; prefill batches carry ``cu_seqlens_q``/``cu_seqlens_k`` and each sequence's
    block table, to gather its keys and values (cached context and this pass's) from.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    logits_indices: torch.Tensor
    is_decode: bool
    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    cu_seqlens_q: list[int] | None = None
    context_lens: list[int] | None = None
    seq_block_tables: list[torch.Tensor] | None = None

    @property
    def cu_seqlens_k(self) -> list[int]:
        assert self.cu_seqlens_q is not None and self.context_lens is not None
        out = [0]
        for i, ctx in enumerate(self.context_lens):
            out.append(out[-1] + ctx + self.cu_seqlens_q[i + 1] - self.cu_seqlens_q[i])
        return out
