"""Turns scheduled requests into forward batches and runs the model over the KV pool."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from splitserve.engine.request import Request
from splitserve.kv.pool import KVPool
from splitserve.model.batch import ForwardBatch
from splitserve.model.llama import LlamaForCausalLM


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, pool: KVPool) -> None:
        self.model = model
        self.pool = pool
        self.block_size = pool.layout.block_size
        self.device = pool.device

    def _slots(self, req: Request, start: int, end: int) -> tuple[list[int], list[int]]:
        bs = self.block_size
        return [req.block_ids[p // bs] for p in range(start, end)], [
            p % bs for p in range(start, end)
        ]

    def decode(self, reqs: Sequence[Request]) -> torch.Tensor:
        """Logits ``[B, vocab]`` for the token after each request's last one."""
        dev = self.device
        blocks, offsets, positions = [], [], []
        for req in reqs:
            pos = req.num_tokens - 1
            blocks.append(req.block_ids[pos // self.block_size])
            offsets.append(pos % self.block_size)
            positions.append(pos)
        width = max(len(r.block_ids) for r in reqs)
        tables = [r.block_ids + [0] * (width - len(r.block_ids)) for r in reqs]
        batch = ForwardBatch(
            input_ids=_long([r.last_token for r in reqs], dev),
            positions=_long(positions, dev),
            slot_blocks=_long(blocks, dev),
            slot_offsets=_long(offsets, dev),
            logits_indices=torch.arange(len(reqs), device=dev),
            is_decode=True,
            block_tables=torch.tensor(tables, dtype=torch.long, device=dev),
            seq_lens=_long([p + 1 for p in positions], dev),
        )
        out = self.model(batch, self.pool.tensor)
        for req in reqs:
            req.num_computed = req.num_tokens
        return out

    def prefill(
        self,
        chunks: Sequence[tuple[Request, int]],
        written: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Computes ``n`` uncached tokens of each request; logits ``[B, vocab]`` at each chunk's
        last token (meaningful only for chunks that reach the request's end). ``written(layer)``
        as each layer's KV is in the pool (``LlamaForCausalLM.forward``)."""
        dev = self.device
        ids: list[int] = []
        positions: list[int] = []
        blocks: list[int] = []
        offsets: list[int] = []
        cu_q = [0]
        context = []
        for req, n in chunks:
            start = req.num_computed
            ids += req.all_ids[start : start + n]
            positions += range(start, start + n)
            b, o = self._slots(req, start, start + n)
            blocks += b
            offsets += o
            cu_q.append(cu_q[-1] + n)
            context.append(start)
        batch = ForwardBatch(
            input_ids=_long(ids, dev),
            positions=_long(positions, dev),
            slot_blocks=_long(blocks, dev),
            slot_offsets=_long(offsets, dev),
            logits_indices=_long([c - 1 for c in cu_q[1:]], dev),
            is_decode=False,
            cu_seqlens_q=cu_q,
            context_lens=context,
            seq_block_tables=[_long(r.block_ids, dev) for r, _ in chunks],
        )
        out = self.model(batch, self.pool.tensor, written)
        for req, n in chunks:
            req.num_computed += n
        return out
