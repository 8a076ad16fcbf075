"""The simulated engine instance runs the engine's own scheduler: its policy (preemption of the
newest request, chunked prefill within the token budget, handed-over KV waiting for blocks)
shows up in simulated time."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from splitserve.engine.scheduler import SchedulerOutput
from splitserve_tools.planner.events import Clock, SimRequest
from splitserve_tools.planner.fit import DecodeFit, DecodeRange, HandoffFit, PrefillFit
from splitserve_tools.planner.instances import EngineInstance
from splitserve_tools.planner.machine import Machine
from splitserve_tools.planner.placement import Limits
from splitserve_tools.planner.profile import Contention
from splitserve_tools.planner.step_model import StepModel

MODEL = StepModel(
    prefill=PrefillFit(0.01, 1e-4, 0.0),
    decode=DecodeFit((DecodeRange(1, 0.02, 1e-4, 0.0),)),
    handoff=HandoffFit(1e-3, 1e10),
    kv_bytes_per_token=1024,
    block_size=16,
    token_s=0.0,
)

Batch = tuple[list[str], list[tuple[str, int]]]
"""One step as the scheduler chose it: the ids decoded, and (id, tokens) prefilled."""


def instance(limits: Limits, blocks: int) -> tuple[Clock, EngineInstance, list[Batch]]:
    """An engine instance alone on its device, and every step its scheduler schedules."""
    clock = Clock()
    engine = EngineInstance(clock, Machine(Contention(), 1), 1, MODEL, limits, blocks)
    steps: list[Batch] = []
    schedule = engine.scheduler.schedule

    def recorded() -> SchedulerOutput:
        out = schedule()
        if not out.empty:
            decodes = [r.request_id for r in out.decodes]
            steps.append((decodes, [(r.request_id, n) for r, n in out.prefills]))
        return out

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    return clock, engine, steps


def prefilled(steps: list[Batch], request_id: str) -> list[int]:
    return [n for _, chunks in steps for rid, n in chunks if rid == request_id]


def test_a_small_pool_preempts_the_newest_and_recomputes_it() -> None:
    """Prompts that fit the pool together but outgrow it while decoding: the scheduler preempts,
    the victim's prompt and tokens so far are computed again, and every request still ends
    with all its tokens and its blocks back in the pool."""
    clock, engine, steps = instance(Limits(), blocks=40)
    sims = [SimRequest(i, 0.0, 100, 100) for i in range(8)]
    for sim in sims:
        clock.at(0.0, lambda sim=sim: engine.add_prompt(sim))
    clock.run()
    assert engine.scheduler.num_preemptions > 0
    assert any(n > 100 for _, chunks in steps for _, n in chunks)  # a recomputed request
    assert all(math.isfinite(s.last) for s in sims)
    assert engine.scheduler.allocator.num_used == 0 and not engine.sims


def test_chunked_prefill_shares_the_token_budget_with_decodes() -> None:
    """A long prompt arrives beside a running stream: with chunking it is computed in chunks of
    the budget left after the decode, the stream decoding in every one of those steps; its
    first token leaves with the last chunk."""
    limits = Limits(max_num_batched_tokens=64, chunked_prefill=True)
    clock, engine, steps = instance(limits, blocks=1000)
    stream, prompt = SimRequest(0, 0.0, 16, 50), SimRequest(1, 0.05, 200, 2)
    clock.at(0.0, lambda: engine.add_prompt(stream))
    clock.at(0.05, lambda: engine.add_prompt(prompt))
    clock.run()
    assert prefilled(steps, "1") == [63, 63, 63, 11]
    chunk_steps = [decodes for decodes, chunks in steps if any(rid == "1" for rid, _ in chunks)]
    assert chunk_steps == [["0"]] * 4
    assert math.isfinite(prompt.last) and math.isfinite(stream.last)


def test_without_chunking_a_prompt_over_the_budget_runs_whole_alone() -> None:
    clock, engine, steps = instance(Limits(max_num_batched_tokens=64), blocks=1000)
    prompt = SimRequest(0, 0.0, 200, 2)
    clock.at(0.0, lambda: engine.add_prompt(prompt))
    clock.run()
    assert prefilled(steps, "0") == [200]
    assert prompt.first == pytest.approx(MODEL.prefill(200, 200 * 200))


def test_handed_over_kv_waits_for_blocks_and_is_released_when_loaded() -> None:
    """Handovers are applied between steps. Decode's pool holds all but the last of the
    handed-over prompts: that one's first token goes out with the others, but its KV stays on
    the prefill instance until a running request leaves; a request that ends on its first
    token releases its KV on the spot."""
    clock, engine, steps = instance(Limits(), blocks=12)
    released: dict[int, float] = {}
    sims = [SimRequest(i, 0.0, 64, 20) for i in range(3)] + [SimRequest(3, 0.0, 64, 1)]
    for sim in sims:
        release = lambda i=sim.idx: released.setdefault(i, clock.now)  # noqa: E731
        clock.at(0.0, lambda sim=sim, release=release: engine.add_prefilled(sim, release))
    clock.run()
    assert sims[0].first == released[0] == 0.0
    assert sims[1].first == sims[2].first == sims[3].first > 0.0  # when the first step ended
    assert released[1] == released[3] == sims[1].first
    assert released[2] >= min(sims[0].last, sims[1].last) > sims[2].first
    assert [decodes for decodes, _ in steps[:2]] == [["0"], ["0", "1"]]
    assert all(math.isfinite(s.last) for s in sims)


def test_a_streamed_handoff_overlaps_the_pass_of_the_role_that_ran_it() -> None:
    link = HandoffFit(1e-3, 1.25e6, stream_layers=4)  # slower than either pass writes KV
    own = replace(MODEL, handoff=link)
    # The pass ran on a prefill instance twice as fast as this (decode) instance's own fit.
    fast = PrefillFit(0.005, 0.5e-4, 0.0)
    sourced = replace(own, source_prefill=fast)
    blocks, tokens = 8, 8 * 16
    nbytes = blocks * MODEL.block_bytes
    assert own.loaded_s(blocks) == pytest.approx(
        link.added_after_pass(nbytes, MODEL.prefill(tokens, tokens * tokens))
    )
    assert sourced.loaded_s(blocks) == pytest.approx(
        link.added_after_pass(nbytes, fast(tokens, tokens * tokens))
    )
    assert sourced.loaded_s(blocks) > own.loaded_s(blocks)  # a shorter pass hides less


def test_prompts_under_the_stream_threshold_move_after_the_pass() -> None:
    link = HandoffFit(1e-3, 1.25e6, stream_layers=4, stream_min_tokens=256)
    model = replace(MODEL, handoff=link)
    short, long = 8, 32  # blocks of 16 tokens: 128 and 512 tokens
    assert model.loaded_s(short) == pytest.approx(link(short * MODEL.block_bytes))
    tokens = long * MODEL.block_size
    assert model.loaded_s(long) == pytest.approx(
        link.added_after_pass(long * MODEL.block_bytes, MODEL.prefill(tokens, tokens * tokens))
    )
    assert HandoffFit.from_dict(link.to_dict()) == link


def test_served_pass_factors_stretch_passes_and_a_streamed_one_again() -> None:
    link = HandoffFit(1e-3, 1.25e6, stream_layers=4, stream_min_tokens=256)
    model = replace(MODEL, handoff=link, pass_factor=1.1, stream_pass_factor=1.2)
    for n, factor in ((128, 1.1), (512, 1.1 * 1.2)):
        assert model.prompt_pass([n]) == pytest.approx(factor * MODEL.prefill(n, n * n))
    assert model.prompt_pass([128, 512]) == pytest.approx(
        1.1 * 1.2 * MODEL.prefill(640, 128**2 + 512**2)
    )
    tokens = 32 * MODEL.block_size  # streamed: what the handoff overlaps is the stretched pass
    assert model.loaded_s(32) == pytest.approx(
        link.added_after_pass(32 * MODEL.block_bytes, model.prompt_pass([tokens]))
    )
