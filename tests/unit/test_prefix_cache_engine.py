"""Prefix caching end to end in the engine: greedy output equal to transformers' and to the
cache off, token for token, for the prompt shapes that share KV; blocks accounted for."""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_reference import hf_greedy

from splitserve import LLM, SamplingParams
from splitserve.engine.engine import Engine
from splitserve.engine.prefix import PrefixStats
from splitserve.engine.prompt_pass import PrefillEngine
from splitserve.engine.request import Request
from splitserve.kv.pool import KVPool

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SYSTEM = list(range(5, 45))  # 40 tokens: 5 full blocks of 8, shared by every prompt below


def prompts() -> list[list[int]]:
    """A shared system prompt, an exact prefix of another prompt, two prompts that differ in
    their last token only, and one on a block boundary."""
    return [
        [*SYSTEM, 300, 301, 302],
        [*SYSTEM, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309],
        [*SYSTEM, 300, 301, 302, 303, 304, 305, 306, 307, 308, 310],
        SYSTEM[:32],
        [*SYSTEM, 400],
    ]


def llm(ckpt: Path, cache: bool, blocks: int = 128) -> LLM:
    return LLM(str(ckpt), max_model_len=256, num_kv_blocks=blocks, block_size=8, prefix_cache=cache)


def stats(engine: LLM) -> PrefixStats:
    prefix = engine.engine.scheduler.prefix
    assert prefix is not None
    return prefix.stats


@pytest.mark.parametrize("name", ["llama32_ckpt", "qwen2_ckpt"])
def test_greedy_equals_transformers_with_shared_prefixes(name, request):
    ckpt = request.getfixturevalue(name)
    cached = llm(ckpt, True)
    first = cached.generate([prompts()[0]], GREEDY, use_tqdm=False)  # fills the cache
    rest = cached.generate(prompts()[1:], GREEDY, use_tqdm=False)  # one batch, all hits
    for ids, out in zip(prompts(), first + rest, strict=True):
        assert out.token_ids == hf_greedy(ckpt, ids, GREEDY.max_tokens, eos_token_ids=())
    s = stats(cached)
    assert s.queries == sum(map(len, prompts()))
    assert s.hits >= 40 * 3 + 32 - 8  # three whole system prompts, the prefix less its last block
    allocator = cached.engine.scheduler.allocator
    assert allocator.num_used == 0 and allocator.num_cached_free == allocator.num_cached > 0


def test_multi_turn_moves_only_new_tokens_and_matches_the_cache_off(llama32_ckpt):
    on, off = llm(llama32_ckpt, True), llm(llama32_ckpt, False)
    history = {"on": list(SYSTEM), "off": list(SYSTEM)}
    for turn in range(4):
        user = [500 + 10 * turn + i for i in range(5)]
        for name, engine in (("on", on), ("off", off)):
            history[name] += user
            out = engine.generate([history[name]], GREEDY, use_tqdm=False)[0]
            history[name] += out.token_ids
        assert history["on"] == history["off"]
    s = stats(on)
    # Every later turn found all of the conversation's full blocks so far.
    assert s.hits >= s.queries - 4 * 8 - len(SYSTEM)
    assert off.engine.scheduler.prefix is None


def test_eviction_pressure_keeps_outputs_and_frees_every_block(llama32_ckpt):
    reference = llm(llama32_ckpt, False)
    tight = llm(llama32_ckpt, True, blocks=32)  # the least that holds one 256-token sequence
    want = [o.token_ids for o in reference.generate(prompts(), GREEDY, use_tqdm=False)]
    for _ in range(2):
        got = [o.token_ids for o in tight.generate(prompts(), GREEDY, use_tqdm=False)]
        assert got == want
        others = [[*range(600 + 100 * i, 700 + 100 * i)] for i in range(3)]  # evict SYSTEM
        tight.generate(others, GREEDY, use_tqdm=False)
    allocator = tight.engine.scheduler.allocator
    assert allocator.num_used == 0 and allocator.num_evictions > 0


def test_aborting_one_of_several_sharers_frees_only_what_nobody_uses(llama32_ckpt):
    engine = llm(llama32_ckpt, True).engine
    solo = llm(llama32_ckpt, False)
    want = [o.token_ids for o in solo.generate(prompts()[:3], GREEDY, use_tqdm=False)]
    out: dict[str, list[int]] = {"0": [], "1": [], "2": []}
    for i, ids in enumerate(prompts()[:3]):
        engine.add_request(str(i), ids, GREEDY)
        for o in engine.step():  # its prompt pass, beside the decodes of those before it
            out[o.request_id] += o.new_token_ids
    running = {r.request_id: r for r in engine.scheduler.running}
    shared = running["0"].block_ids[:5]
    assert shared == running["1"].block_ids[:5] == running["2"].block_ids[:5]
    engine.abort("1")
    assert engine.scheduler.allocator.num_used == len(
        set(running["0"].block_ids) | set(running["2"].block_ids)
    )
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    assert out["0"] == want[0] and out["2"] == want[2]
    assert engine.scheduler.allocator.num_used == 0


class CopySource:
    """Hands KV over by copying blocks between two in-process pools, then frees the owner's."""

    def __init__(self, prefill: PrefillEngine, req: Request, dst: KVPool) -> None:
        self.prefill, self.req, self.dst = prefill, req, dst

    def load(self, dst_block_ids: list[int], skip: int = 0) -> None:
        self.skipped = skip
        src = self.prefill.runner.pool.read_blocks(self.req.block_ids[skip:])
        self.dst.write_blocks(dst_block_ids, src)
        self.prefill.free(self.req)

    def discard(self) -> None:
        self.prefill.free(self.req)


def test_disaggregated_prefill_reuses_its_cache_and_decode_caches_what_arrives(llama32_ckpt):
    reference = llm(llama32_ckpt, False)
    want = [o.token_ids for o in reference.generate(prompts(), GREEDY, use_tqdm=False)]
    parts_llm = llm(llama32_ckpt, True)
    decode: Engine = parts_llm.engine
    model = decode.runner.model
    src_pool = KVPool(decode.runner.pool.layout, 64)
    prefill = PrefillEngine(model, src_pool, decode.eos_ids, decode.max_model_len, True)
    out: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts()):
        req = Request(str(i), ids, GREEDY)
        first = prefill.prefill([req])[0]
        source = CopySource(prefill, req, decode.runner.pool)
        out[str(i)] = decode.add_prefilled(
            str(i), ids, GREEDY, first, req.seed, source
        ).new_token_ids
        while decode.has_unfinished():
            for o in decode.step():
                out[o.request_id] += o.new_token_ids
    assert [out[str(i)] for i in range(len(prompts()))] == want
    assert prefill.prefix is not None and prefill.prefix.stats.hits >= 40 * 3
    assert src_pool.allocator.num_used == 0 and src_pool.allocator.num_cached > 0
    assert decode.scheduler.allocator.num_used == 0
    assert decode.scheduler.allocator.num_cached >= 5  # the system prompt's blocks arrived
    prefix = decode.scheduler.prefix
    assert prefix is not None
    # Every prompt after the first found the system prompt's 5 blocks in decode's own cache.
    assert prefix.stats.blocks_skipped >= 5 * (len(prompts()) - 1)
    assert prefix.stats.blocks_pulled + prefix.stats.blocks_skipped == sum(
        -(-len(p) // 8) for p in prompts()
    )


def test_prefill_admission_counts_shared_cached_blocks_as_taking_nothing(llama32_ckpt):
    engine = llm(llama32_ckpt, True).engine
    pool = KVPool(engine.runner.pool.layout, 16)
    prefill = PrefillEngine(engine.runner.model, pool, engine.eos_ids, engine.max_model_len, True)
    first, second = Request("a", [*SYSTEM, 300], GREEDY), Request("b", [*SYSTEM, 301, 302], GREEDY)
    assert prefill.free_blocks_for(second) == 6
    prefill.prefill([first])  # its 6 blocks stay leased; the system prompt's 5 are cached
    assert prefill.free_blocks_for(second) == 1
    prefill.prefill([second])
    assert pool.allocator.num_used == 7
    prefill.free(first)
    prefill.free(second)
    # Cached but nobody's: taking them costs free blocks again.
    assert prefill.free_blocks_for(Request("c", [*SYSTEM, 303], GREEDY)) == 6
