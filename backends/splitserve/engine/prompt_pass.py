"""The prefill stage of disaggregated serving: one packed pass over many prompts.

Each request's KV stays in its blocks after the pass; the caller hands the block ids over (as a
lease) and frees them once decode has pulled them. With prefix caching, a prompt's blocks
start with the pool's cached blocks of its longest cached prefix (shared with other requests,
read-only) and the pass computes only the rest; handed over, cached and new blocks alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from splitserve.engine.prefix import PrefixCache
from splitserve.engine.request import Request
from splitserve.engine.runner import ModelRunner
from splitserve.engine.sampler import sample, suppressed_tokens
from splitserve.engine.validate import validate_prompt
from splitserve.kv.allocator import OutOfBlocks
from splitserve.kv.block_hash import layout_key
from splitserve.kv.pool import KVPool
from splitserve.model.llama import LlamaForCausalLM


class PrefillEngine:
    def __init__(
        self,
        model: LlamaForCausalLM,
        pool: KVPool,
        eos_ids: tuple[int, ...],
        max_model_len: int,
        prefix_cache: bool = False,
    ) -> None:
        self.runner = ModelRunner(model, pool)
        self.allocator = pool.allocator
        self.block_size = pool.layout.block_size
        self.prefix = (
            PrefixCache(pool.allocator, self.block_size, layout_key(pool.layout))
            if prefix_cache
            else None
        )
        self.eos_ids = eos_ids
        self.vocab_size = model.cfg.vocab_size
        self.max_model_len = max_model_len

    def prefill(self, reqs: Sequence[Request]) -> list[int]:
        """Compute every prompt in one forward pass; returns each request's first token.

        On success each ``req.block_ids`` holds its prompt's KV (owned by the caller now).
        Raises OutOfBlocks, with nothing allocated, when the pool cannot hold them all.
        """
        self.allocate(reqs)
        try:
            return self.run(reqs)
        except BaseException:
            for req in reqs:
                self.free(req)
            raise

    def allocate(self, reqs: Sequence[Request]) -> None:
        """Give each request the blocks of its prompt (the caller's until it frees or leases
        them); OutOfBlocks, with nothing allocated, if they do not all fit."""
        for req in reqs:
            self.check(req)
        if self.prefix is not None:
            for req in reqs:
                self.prefix.attach(req)
        need = sum(self.blocks_for(r) - len(r.block_ids) for r in reqs)
        if not self.allocator.can_allocate(need):
            for req in reqs:
                self.free(req)
            raise OutOfBlocks(f"prefill needs {need} blocks, {self.allocator.num_free} free")
        for req in reqs:
            if self.prefix is not None:
                self.prefix.count(req)
            req.block_ids += self.allocator.allocate(self.blocks_for(req) - len(req.block_ids))

    def run(
        self, reqs: Sequence[Request], written: Callable[[int], None] | None = None
    ) -> list[int]:
        """The pass over allocated requests; their first tokens. ``written(layer)`` runs as each
        layer's KV is in their blocks. Frees nothing if it raises."""
        chunks = [(r, len(r.prompt_ids) - r.num_computed) for r in reqs]
        if self.prefix is None:
            logits = self.runner.prefill(chunks, written)
        elif written is None:
            logits = self.runner.prefill(chunks)
            self._commit(reqs)
        else:
            # Cache the blocks before the last layer is announced: a reader that has every
            # layer may release (and so free) them before the pass returns.
            last = self.runner.model.cfg.num_layers - 1

            def announced(layer: int) -> None:
                if layer == last:
                    self._commit(reqs)
                written(layer)

            logits = self.runner.prefill(chunks, announced)
        suppress = [suppressed_tokens(r.params, 0, self.eos_ids, self.vocab_size) for r in reqs]
        return sample(logits, reqs, suppress)

    def _commit(self, reqs: Sequence[Request]) -> None:
        assert self.prefix is not None
        for req in reqs:
            self.prefix.commit(req, len(req.prompt_ids))

    def check(self, req: Request) -> None:
        """Raise ValueError naming the problem if ``req`` cannot be prefilled here."""
        validate_prompt(req.prompt_ids, self.vocab_size, self.max_model_len)

    def blocks_for(self, req: Request) -> int:
        return -(-len(req.prompt_ids) // self.block_size)

    def free_blocks_for(self, req: Request) -> int:
        """Of the pool's free blocks, how many ``req``'s prompt takes: all its blocks but the
        cached ones that other requests hold (and so share with it)."""
        held = self.prefix.held_prefix(req) if self.prefix is not None else 0
        return self.blocks_for(req) - held

    def free(self, req: Request) -> None:
        """Give back ``req``'s blocks (cached ones stay cached) and what the pass computed."""
        if req.block_ids:
            self.allocator.free(req.block_ids)
            req.block_ids = []
        req.num_cached_blocks = 0
        req.num_computed = 0
