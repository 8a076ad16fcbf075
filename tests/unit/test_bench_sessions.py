"""Workloads whose prompts share prefixes: the sessions' lengths, their prompt texts, and the
runner sending a session's turns one after another."""

from __future__ import annotations

import asyncio
import time

import pytest

from splitserve.tokenizer import ByteTokenizer
from splitserve_client.stream import RequestRecord
from splitserve_tools.bench.main import BenchOptions, build_requests, schedule
from splitserve_tools.bench.prompts import prompt_maker
from splitserve_tools.bench.requests import Request, make_session_requests
from splitserve_tools.bench.runner import run_schedule
from splitserve_tools.workload.sessions import SESSION_SECONDS, probe_turns, session_turns


def test_each_turn_repeats_the_last_with_its_reply_and_fits_the_context() -> None:
    turns = session_turns("multi-turn", 60, 1024, seed=3)
    assert len(turns) == 60
    assert len({t.segments[0] for t in turns}) == 1  # one system prompt for all
    for i, t in enumerate(turns):
        assert t.input_len + t.output_len <= 1024
        if t.follows is None:
            assert t.index == 0 and len(t.segments) == 2
            continue
        prev = turns[t.follows]
        assert t.follows == i - 1 and (prev.session, prev.index + 1) == (t.session, t.index)
        assert t.segments[: len(prev.segments)] == prev.segments
        assert t.segments[len(prev.segments)] == prev.output_len
    sessions = {t.session for t in turns}
    assert len(sessions) < 60 and max(t.index for t in turns) >= 2


def test_shared_prefix_prompts_are_single_turns_behind_one_system_prompt() -> None:
    turns = session_turns("shared-prefix", 20, 2048, seed=1)
    assert all(t.follows is None and len(t.segments) == 2 for t in turns)
    assert len({t.segments[0] for t in turns}) == 1
    with pytest.raises(ValueError, match="fits no turn"):
        session_turns("shared-prefix", 1, 3)


def test_session_texts_repeat_earlier_turns_verbatim_with_exact_lengths() -> None:
    tok = ByteTokenizer()
    turns = session_turns("multi-turn", 12, 1024, seed=5)
    requests = make_session_requests(turns, prompt_maker(tok), seed=7)
    system = requests[0].prompt_text[: turns[0].segments[0] - 1]  # the BOS is no text
    for turn, req in zip(turns, requests, strict=True):
        assert len(tok.encode(req.prompt_text)) == req.input_len == turn.input_len
        assert req.prompt_text.startswith(system)
        if turn.follows is not None:
            assert req.prompt_text.startswith(requests[turn.follows].prompt_text)
            assert (req.turn, req.follows) == (turn.index, turn.follows)


def test_sessions_arrive_at_the_rate_and_later_turns_wait_for_the_earlier() -> None:
    opts = BenchOptions(targets=["llm"], workload="multi-turn", num_requests=10, max_model_len=512)
    requests = build_requests(opts, 2.0)
    plan = schedule(opts, requests, 2.0)
    for offset, req in plan:
        if req.follows is not None:
            assert offset == plan[req.follows][0]
    firsts = [offset for offset, req in plan if req.follows is None]
    assert firsts == sorted(firsts)


def test_a_session_probe_sends_a_minute_of_turns_at_its_rate() -> None:
    opts = BenchOptions(targets=["llm"], workload="multi-turn", num_requests=10, max_model_len=512)
    assert len(build_requests(opts)) == 10
    fast = build_requests(opts, 2.0)
    assert len(fast) == probe_turns(10, 2.0) == 2 * SESSION_SECONDS
    first = session_turns("multi-turn", 10, 512)
    assert [r.input_len for r in fast[:10]] == [t.input_len for t in first]
    assert probe_turns(500, 2.0) == 500


class Recorder:
    """A target that answers after 20 ms and keeps when each prompt was sent."""

    name = "recorder"

    def __init__(self) -> None:
        self.sent: dict[str, float] = {}

    async def generate(self, prompt: str, max_tokens: int) -> RequestRecord:
        start = time.perf_counter()
        self.sent[prompt] = start
        await asyncio.sleep(0.02)
        now = time.perf_counter()
        return RequestRecord(start=start, token_times=[now], end=now, output_tokens=1)

    async def close(self) -> None:
        return None


def test_the_runner_sends_a_later_turn_its_think_time_after_the_turn_before_ended() -> None:
    first = Request("a", 1, 1)
    second = Request("ab", 2, 1, turn=1, follows=0, think_s=0.05)
    other = Request("x", 1, 1)
    target = Recorder()
    result = asyncio.run(
        run_schedule(target, [(0.0, first), (0.0, second), (0.01, other)], progress=False)
    )
    ended = result.records[0].end
    assert target.sent["ab"] >= ended + 0.05
    assert target.sent["x"] < ended  # other sessions do not wait
