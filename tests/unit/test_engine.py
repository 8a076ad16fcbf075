"""Engine behaviour on the built-in tiny model: batching, handoff, stopping, accounting."""

import dataclasses

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.build import build_components, scheduler_limits
from splitserve.engine.engine import Engine
from splitserve.engine.prompt_pass import PrefillEngine
from splitserve.engine.request import Request
from splitserve.engine_config import EngineConfig
from splitserve.kv.pool import KVPool

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [
    [256, 72, 101, 108, 108, 111],
    [256, *range(1, 40)],
    [256, 50],
    [256, *range(100, 117)],
    [256, *range(60, 107)],
]


@pytest.fixture(scope="module")
def parts():
    return build_components(
        EngineConfig(model="tiny", num_kv_blocks=64, max_num_seqs=8, max_model_len=128)
    )


def new_engine(parts, **limits) -> Engine:
    cfg = EngineConfig(model="tiny", num_kv_blocks=64, **limits)
    return Engine(
        parts.model, parts.new_pool(), parts.tokenizer, scheduler_limits(cfg), parts.max_model_len
    )


def run(engine: Engine, reqs: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {rid: [] for rid in reqs}
    for rid, (ids, p) in reqs.items():
        engine.add_request(rid, ids, p)
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


def solo(parts, ids: list[int], p: SamplingParams = GREEDY) -> list[int]:
    return run(new_engine(parts), {"x": (ids, p)})["x"]


def test_batch_equals_solo_and_frees_every_block(parts):
    engine = new_engine(parts)
    batched = run(engine, {str(i): (p, GREEDY) for i, p in enumerate(PROMPTS)})
    for i, p in enumerate(PROMPTS):
        assert batched[str(i)] == solo(parts, p)
    assert engine.scheduler.allocator.num_used == 0


def test_requests_joining_and_leaving_mid_generation(parts):
    engine = new_engine(parts)
    short = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    got: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    engine.add_request("a", PROMPTS[0], GREEDY)
    engine.add_request("b", PROMPTS[1], short)
    for step in range(30):
        if step == 3:
            engine.add_request("c", PROMPTS[2], GREEDY)
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    assert got["a"] == solo(parts, PROMPTS[0])
    assert got["b"] == solo(parts, PROMPTS[1], short)
    assert got["c"] == solo(parts, PROMPTS[2])


def test_chunked_prefill_and_preemption_keep_outputs(parts):
    chunked = new_engine(parts, chunked_prefill=True, max_num_batched_tokens=7)
    outs = run(chunked, {str(i): (p, GREEDY) for i, p in enumerate(PROMPTS)})
    assert [outs[str(i)] for i in range(len(PROMPTS))] == [solo(parts, p) for p in PROMPTS]
    cfg = EngineConfig(model="tiny", num_kv_blocks=8)
    small = Engine(
        parts.model,
        KVPool(parts.layout, 8),
        parts.tokenizer,
        scheduler_limits(cfg),
        parts.max_model_len,
    )
    outs = run(small, {str(i): (p, GREEDY) for i, p in enumerate(PROMPTS)})
    assert [outs[str(i)] for i in range(len(PROMPTS))] == [solo(parts, p) for p in PROMPTS]
    assert small.scheduler.allocator.num_used == 0
    assert small.scheduler.num_preemptions > 0


class CopySource:
    """Hands KV over by copying blocks between two in-process pools."""

    def __init__(self, prefill: PrefillEngine, req: Request, dst_pool: KVPool) -> None:
        self.prefill, self.req, self.dst_pool = prefill, req, dst_pool
        self.loaded = self.discarded = False

    def load(self, dst: list[int], skip: int = 0) -> None:
        assert len(dst) == len(self.req.block_ids) - skip
        data = self.prefill.runner.pool.read_blocks(self.req.block_ids[skip:])
        self.dst_pool.write_blocks(dst, data)
        self.loaded = True
        self.prefill.free(self.req)

    def discard(self) -> None:
        self.discarded = True
        self.prefill.free(self.req)


def test_handoff_prefill_on_a_decode_on_b(parts):
    prefill = PrefillEngine(parts.model, parts.new_pool(), parts.eos_ids, parts.max_model_len)
    decode = new_engine(parts)
    reqs = [Request(str(i), p, GREEDY) for i, p in enumerate(PROMPTS)]
    first = prefill.prefill(reqs)
    got: dict[str, list[int]] = {}
    for req, tok in zip(reqs, first, strict=True):
        source = CopySource(prefill, req, decode.runner.pool)
        out = decode.add_prefilled(req.request_id, req.prompt_ids, GREEDY, tok, req.seed, source)
        got[req.request_id] = out.new_token_ids
    while decode.has_unfinished():
        for o in decode.step():
            got[o.request_id] += o.new_token_ids
    assert [got[str(i)] for i in range(len(PROMPTS))] == [solo(parts, p) for p in PROMPTS]
    assert prefill.allocator.num_used == 0 and decode.scheduler.allocator.num_used == 0


def test_handoff_sources_are_discarded_when_never_loaded(parts):
    prefill = PrefillEngine(parts.model, parts.new_pool(), parts.eos_ids, parts.max_model_len)
    decode = new_engine(parts)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    reqs = [Request("a", PROMPTS[0], one), Request("b", PROMPTS[1], GREEDY)]
    first = prefill.prefill(reqs)
    src_a = CopySource(prefill, reqs[0], decode.runner.pool)
    out = decode.add_prefilled("a", PROMPTS[0], one, first[0], 0, src_a)
    assert out.finished and out.finish_reason == "length" and src_a.discarded and not src_a.loaded
    src_b = CopySource(prefill, reqs[1], decode.runner.pool)
    decode.add_prefilled("b", PROMPTS[1], GREEDY, first[1], 0, src_b)
    assert decode.abort("b") and src_b.discarded and not src_b.loaded
    assert prefill.allocator.num_used == 0 and decode.scheduler.allocator.num_used == 0


class LostSource:
    def load(self, dst: list[int], skip: int = 0) -> None:
        raise RuntimeError("lease expired")

    def discard(self) -> None:
        raise AssertionError("a failed load is not a discard")


def test_failed_handoff_under_the_fail_policy_ends_with_an_error(parts):
    cfg = EngineConfig(model="tiny", num_kv_blocks=64)
    limits = dataclasses.replace(scheduler_limits(cfg), on_handoff_failure="fail")
    decode = Engine(parts.model, parts.new_pool(), parts.tokenizer, limits, parts.max_model_len)
    decode.add_prefilled("a", PROMPTS[1], GREEDY, 5, 0, LostSource())
    (out,) = decode.step()
    assert out.finished and out.finish_reason == "error" and out.new_token_ids == []
    assert out.error is not None and "lease expired" in out.error
    assert not decode.has_unfinished() and decode.scheduler.allocator.num_used == 0


def test_seeded_sampling_is_independent_of_batch(parts):
    p = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=40, seed=7, ignore_eos=True)
    alone = solo(parts, PROMPTS[0], p)
    engine = new_engine(parts)
    batched = run(engine, {"x": (PROMPTS[0], p), "y": (PROMPTS[1], GREEDY), "z": (PROMPTS[2], p)})
    assert batched["x"] == alone
    other = solo(
        parts, PROMPTS[0], SamplingParams(max_tokens=16, temperature=0.9, seed=8, ignore_eos=True)
    )
    assert other != alone


def test_stops_on_token_ids_and_max_tokens(parts):
    ref = solo(parts, PROMPTS[0])
    stop_at = ref[5]
    p = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_at])
    engine = new_engine(parts)
    out = run(engine, {"x": (PROMPTS[0], p)})["x"]
    assert out == ref[: ref.index(stop_at) + 1]
    p = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop_at], min_tokens=10)
    out = run(engine, {"x": (PROMPTS[0], p)})["x"]
    assert (
        len(out) > ref.index(stop_at) + 1 and out[: ref.index(stop_at)] == ref[: ref.index(stop_at)]
    )


def test_stop_string_truncates_text():
    llm = LLM("tiny", num_kv_blocks=64, max_model_len=128)
    full = llm.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False
    )[0]
    needle = full.text[4:6]
    out = llm.generate(
        [PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0.0, stop=[needle]), use_tqdm=False
    )[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(needle)]


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("max_tokens", {"max_tokens": 0}),
        ("temperature", {"temperature": -0.5}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.5}),
        ("min_tokens", {"min_tokens": 5, "max_tokens": 2}),
    ],
)
def test_bad_sampling_params_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_name_the_field_and_leave_no_blocks():
    llm = LLM("tiny", num_kv_blocks=64, max_model_len=32)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([PROMPTS[0], list(range(40))], GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.allocator.num_used == 0
    assert not llm.engine.has_unfinished()


def test_abort_frees_blocks(parts):
    engine = new_engine(parts)
    engine.add_request("a", PROMPTS[1], GREEDY)
    engine.step()
    assert engine.scheduler.allocator.num_used > 0
    assert engine.abort("a") and not engine.abort("a")
    assert engine.scheduler.allocator.num_used == 0


def test_length_capped_by_max_model_len():
    llm = LLM("tiny", num_kv_blocks=64, max_model_len=20)
    out = llm.generate(
        [PROMPTS[0]],
        SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert out.finish_reason == "length" and len(PROMPTS[0]) + len(out.token_ids) == 20
    assert torch.get_num_threads() >= 1
