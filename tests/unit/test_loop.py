import dataclasses
import threading
from contextlib import contextmanager
from typing import Any

from splitserve import SamplingParams
from splitserve.engine.build import build_components, scheduler_limits
from splitserve.engine.engine import Engine
from splitserve.engine.output import RequestOutput
from splitserve.engine_config import EngineConfig
from splitserve.serving.loop import EngineLoop


class ListSink:
    def __init__(self, cancel_after: int | None = None) -> None:
        self.outputs: list[RequestOutput] = []
        self.error: str | None = None
        self.done = threading.Event()
        self.cancel_after = cancel_after

    def send(self, out: RequestOutput) -> None:
        self.outputs.append(out)
        if out.finished:
            self.done.set()

    def fail(self, message: str, kind: str) -> None:
        self.error = f"{kind}: {message}"
        self.done.set()

    def cancelled(self) -> bool:
        return self.cancel_after is not None and len(self.outputs) >= self.cancel_after

    @property
    def tokens(self) -> list[int]:
        return [t for o in self.outputs for t in o.new_token_ids]


def make_loop(on_handoff_failure: str = "recompute", **kwargs: Any) -> EngineLoop:
    cfg = EngineConfig(model="tiny", num_kv_blocks=64, max_model_len=128)
    parts = build_components(cfg)
    limits = dataclasses.replace(scheduler_limits(cfg), on_handoff_failure=on_handoff_failure)
    engine = Engine(parts.model, parts.new_pool(), parts.tokenizer, limits, parts.max_model_len)
    return EngineLoop(engine, cancel_poll_s=0.0, **kwargs)


def test_streams_requests_and_ends_each_once():
    loop = make_loop()
    loop.start()
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    sinks = [ListSink() for _ in range(4)]
    for i, sink in enumerate(sinks):
        loop.add_request(str(i), [256, 10 + i, 20], p, sink)
    bad = ListSink()
    loop.add_request("bad", [], p, bad)
    for sink in [*sinks, bad]:
        assert sink.done.wait(10)
    loop.stop()
    for sink in sinks:
        assert len(sink.tokens) == 12 and [o.finished for o in sink.outputs].count(True) == 1
        assert sink.outputs[-1].finished and sink.outputs[-1].finish_reason == "length"
    assert bad.error is not None and "prompt" in bad.error
    assert loop.engine.scheduler.allocator.num_used == 0


def test_each_step_reports_its_time_and_sampled_tokens():
    steps: list[tuple[float, int, float]] = []
    loop = make_loop(on_step=lambda seconds, tokens, cpu: steps.append((seconds, tokens, cpu)))
    loop.start()
    p = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    sinks = [ListSink() for _ in range(3)]
    for i, sink in enumerate(sinks):
        loop.add_request(str(i), [256, 30 + i], p, sink)
    for sink in sinks:
        assert sink.done.wait(10)
    loop.stop()
    assert len(steps) == loop.num_steps
    assert all(seconds > 0 and cpu > 0 for seconds, _, cpu in steps)
    assert sum(tokens for _, tokens, _ in steps) == sum(len(s.tokens) for s in sinks) == 15


def test_cancelled_request_is_dropped_and_freed():
    loop = make_loop()
    loop.start()
    sink = ListSink(cancel_after=3)
    loop.add_request(
        "c", [256, 1, 2], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True), sink
    )
    assert sink.done.wait(10)
    loop.stop()
    assert sink.outputs[-1].finish_reason == "cancelled"
    assert len(sink.tokens) < 10
    assert loop.engine.scheduler.allocator.num_used == 0 and not loop.engine.has_unfinished()


def test_engine_loop_runs_every_step_inside_around_step():
    entered: list[int] = []

    @contextmanager
    def around(size: int):
        entered.append(size)
        yield

    loop = make_loop(around_step=around)
    loop.start()
    sink = ListSink()
    loop.add_request("0", [256, 7], SamplingParams(max_tokens=4, temperature=0.0), sink)
    assert sink.done.wait(10)
    loop.stop()
    assert len(entered) == loop.num_steps > 0 and set(entered) == {1}


class LostSource:
    def load(self, dst: list[int], skip: int = 0) -> None:
        raise RuntimeError("transfer abandoned")

    def discard(self) -> None:
        raise AssertionError("a failed load is not a discard")


def test_lost_handoff_ends_with_unavailable_under_the_fail_policy():
    loop = make_loop("fail")
    loop.start()
    p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    sink = ListSink()
    loop.add_prefilled("a", [256, 7, 8, 9], p, 5, 0, LostSource(), sink)
    assert sink.done.wait(10)
    loop.stop()
    assert sink.error is not None and sink.error.startswith("unavailable: ")
    assert "transfer abandoned" in sink.error and sink.tokens == [5]
    assert loop.num_active == 0 and loop.engine.scheduler.allocator.num_used == 0
